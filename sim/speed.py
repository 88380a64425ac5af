"""`splitserve sim bench`: how fast the simulator itself runs. Replays the Mooncake trace
(repeated past its end when more requests are asked for) on W simulated workers at a
given load per worker and prints simulated requests per wall second, per tenth of the
run too, and what the slower of the run's rate and its last tenth's projects for the
issue's target: one million requests over 512 workers in under ten minutes. The rate
falls as a run ages (the pools fill at ~23,000 requests on 512 workers, then every
prompt evicts; memory scatters), so a short run's average overstates the million.
`--profile` prints the hot path (cProfile, top functions by own time).

It also times the gateway's routing of one request on the cluster the run left behind
(the production Locality and Router; the in-process index standing in for Redis): the
next `--route-sample` requests of the trace, each looked up, filled and routed (nothing
is sent), in microseconds per request.

Its reference, measured in the same run: the machine's L3 and memory latency before and
after it (bench/memprobe.py, in a process of its own), and the L3's at the start of each
tenth (CacheProbe, the run paused and that time left out of its figures). A late run at
16-token blocks waits on memory more than on the interpreter, and this box shares its L3
with neighbours: the thirteenth session's code ran 100,000 requests in ~65-69 s on its
day and in 132.5 s on a later one (side by side with that day's code, 120.3 s), so a
figure reads against the latencies beside it.

`--pool-churn` holds the per-block work to its machine limit: the engine's block pool
taking a prompt's worth of blocks (each evicting a cached one), caching and freeing
them, per block and step, in one pool (its memory in the CPU's caches), in as many full
pools as the run had workers, a random one each time (every prompt goes to a pool whose
memory the CPU has not touched for a while), and the same steps timed inside the run
(the run wraps its workers' KVCacheManager calls for it). Against one pool, the second
is what the pools' own memory adds; the third, what the rest of the run adds (its
working set evicts a pool's lines between a prompt's steps).

`--breakdown` splits the run's wall time (sim/accounting.py): the production engines'
and gateway's code, the in-process index, the simulator's own, for the run and for each
tenth of it (which part slows as the run ages). The first two are a floor under any
simulator that runs them: their share alone, projected to a million requests, says how
far the target is from the code the simulator must run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import resource
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

from bench import memprobe
from bench.report import machine
from engine.kv_cache_manager import KVCacheManager
from sim import arenas
from sim.accounting import Accounting
from sim.cluster import Simulator
from sim.config import ClusterConfig
from sim.gateway import run_sync
from sim.native import compiled_modules
from sim.profile import load_profile, with_block_size
from sim.request import Tokens
from sim.run_cli import MOONCAKE_TRACE, routing_profile
from sim.split import RemoteGateway
from sim.workload import SimRequestSpec, mooncake, trace_rate

TARGET_REQUESTS, TARGET_WORKERS, TARGET_S = 1_000_000, 512, 600.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--prefill-share", type=float, default=0.0,
                   help="fraction of workers in the prefill pool (0: all colocated)")
    p.add_argument("--rate-per-worker", type=float, default=0.5, help="req/s per worker")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--block-size", type=int, default=0,
                   help="override the profile's (its pool keeps as many tokens)")
    p.add_argument("--routing", default="cache_aware")
    p.add_argument("--trace", default=MOONCAKE_TRACE)
    p.add_argument("--profile", action="store_true", help="cProfile the run")
    p.add_argument("--breakdown", action="store_true",
                   help="split the wall time: engine, gateway, index, simulator "
                        "(sim/accounting.py; ~1 us per wrapped call)")
    p.add_argument("--route-sample", type=int, default=500,
                   help="requests routed again after the run to time routing (0: skip)")
    p.add_argument("--pool-churn", action="store_true",
                   help="after the run: the block pool's per-block cost in one pool vs in "
                        "the run's pools (memory latency's share)")
    p.add_argument("--memprobe-mib", type=int, default=memprobe.REGION_MIB,
                   help="the region the machine's memory latency is measured over before "
                        "and after the run, with its L3's (bench/memprobe.py, ~5 s each; "
                        "the L3 sampled at each tenth too, ~0.2 s each; 0: none of them)")
    p.add_argument("--gateway-process", action="store_true",
                   help="the gateway (index, load reports, routing) in a process of its "
                        "own: the same results on two cores (sim/split.py); --breakdown, "
                        "--pool-churn and the route sample need it in this one")
    p.add_argument("--json", default=None)


STEPS = ("take", "cache", "free")  # a prompt's blocks through the pool, in order


def pool_churn(pools: int, num_blocks: int, per_request: int, requests: int,
               seed: int = 0) -> dict[str, float]:
    """Nanoseconds per block of each step (`STEPS`) for `requests` prompts of
    `per_request` blocks, each taken from a random one of `pools` full pools of
    `num_blocks` cached blocks (evicting as many), cached under new hashes and freed, as
    the simulated workers' pools do. With many pools the three steps of a prompt are
    apart (other prompts' in between, as other workers' events come between a step's
    start, its end and the request's), so each finds its blocks where the memory left
    them; one pool does them back to back.

    Timed in the pools' steady state: the same churn first runs untimed until every
    pool has cached twice its size anew. A prefix map (a dict) under churn compacts
    itself every ~2x its size of new entries (its deletions leave holes); a pool new to
    churn has not yet, and a run's pools do, a million requests over."""
    import random
    from collections import deque

    from engine.block_pool import BlockPool, KVBlock

    if not 0 < per_request <= num_blocks:
        raise ValueError(f"per_request must be in 1..{num_blocks}, got {per_request}")
    rng = random.Random(seed)
    # prompts between a prompt's take and its caching, and between its caching and its
    # free: at most as many as one pool can hold at once (all of them in one pool)
    lag = min(32, pools // 8, num_blocks // (2 * per_request))
    next_hash = 0
    spent = dict.fromkeys(STEPS, 0.0)
    clock = time.perf_counter

    def take(pool: BlockPool, n: int) -> tuple[BlockPool, list[KVBlock]]:
        t = clock()
        blocks = pool.get_new_blocks(n)
        spent["take"] += clock() - t
        if blocks is None:
            raise RuntimeError("pool churn: a pool ran dry (too many prompts in flight)")
        return pool, blocks

    def cache(pool: BlockPool, blocks: list[KVBlock]) -> None:
        nonlocal next_hash
        hashes = list(range(next_hash, next_hash + len(blocks)))
        next_hash += len(blocks)
        t = clock()
        pool.cache_full_blocks(blocks, hashes, None)
        spent["cache"] += clock() - t

    def free(pool: BlockPool, blocks: list[KVBlock]) -> None:
        t = clock()
        pool.free(reversed(blocks))
        pool.take_events()
        spent["free"] += clock() - t

    def churn(n: int) -> None:
        taken: deque[tuple[BlockPool, list[KVBlock]]] = deque()
        cached: deque[tuple[BlockPool, list[KVBlock]]] = deque()
        for _ in range(n):
            taken.append(take(full[rng.randrange(pools)], per_request))
            if len(taken) > lag:
                cache(*taken[0])
                cached.append(taken.popleft())
            if len(cached) > lag:
                free(*cached.popleft())
        for prompt in taken:
            cache(*prompt)
        for prompt in (*cached, *taken):
            free(*prompt)

    full = []
    for _ in range(pools):
        pool, blocks = take(BlockPool(num_blocks), num_blocks)
        cache(pool, blocks)  # every block cached: each later take evicts
        free(pool, blocks)
        full.append(pool)
    churn(-(-2 * pools * num_blocks // per_request))  # to the steady state, untimed
    spent.update(dict.fromkeys(STEPS, 0.0))
    churn(requests)
    return {k: v / (requests * per_request) * 1e9 for k, v in spent.items()}


class RunPoolTimes:
    """What the engine's pool steps cost per block inside a run: the simulated workers'
    KVCacheManager calls that take a request's new blocks (allocate_slots; a prefix
    hit's blocks are not counted), cache them (cache_blocks) and free them (free: the
    blocks no other request holds), wrapped on each worker's instance (the pool is
    compiled: its own methods cannot be). The wrapping adds ~1 us a call to the run."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(STEPS, 0.0)
        self.blocks = dict.fromkeys(STEPS, 0)

    def install(self, sim: Simulator) -> RunPoolTimes:
        for w in sim.workers.values():
            kv = w.kv
            kv.allocate_slots = self._allocate(kv, kv.allocate_slots)  # type: ignore[method-assign]
            kv.cache_blocks = self._counted(  # type: ignore[method-assign]
                kv.cache_blocks, "cache", kv.pool, "num_cached_blocks")
            kv.free = self._counted(  # type: ignore[method-assign]
                kv.free, "free", kv.pool, "num_free_blocks")
        return self

    def _allocate(self, kv: KVCacheManager, fn: Callable[..., bool]) -> Callable[..., bool]:
        seconds, blocks, clock = self.seconds, self.blocks, time.perf_counter

        def allocate_slots(request: Any, num_new_tokens: int,
                           new_computed_blocks: list[Any] | None = None) -> bool:
            before = len(kv.req_blocks.get(request.request_id, ()))
            t = clock()
            ok = fn(request, num_new_tokens, new_computed_blocks)
            seconds["take"] += clock() - t
            if ok:
                blocks["take"] += len(kv.req_blocks[request.request_id]) - before \
                    - len(new_computed_blocks or ())
            return ok
        return allocate_slots

    def _counted(self, fn: Callable[..., None], step: str, pool: Any,
                 count: str) -> Callable[..., None]:
        """`fn` timed; its blocks: how far the pool's `count` moved."""
        seconds, blocks, clock = self.seconds, self.blocks, time.perf_counter

        def timed(*args: Any) -> None:
            before = getattr(pool, count)
            t = clock()
            fn(*args)
            seconds[step] += clock() - t
            blocks[step] += abs(getattr(pool, count) - before)
        return timed

    def per_block_ns(self) -> dict[str, float]:
        return {k: self.seconds[k] / max(1, self.blocks[k]) * 1e9 for k in STEPS}


def route_cost(sim: Simulator, specs: list[SimRequestSpec]) -> dict[str, float]:
    """Microseconds per request of the gateway's routing steps on `sim`'s final state:
    the index lookup, Locality.fill, and Router.route with the registry's candidates."""
    from gateway.routing.base import RouteRequest

    bs = sim.profile.block_size
    reqs = [RouteRequest(f"t{i}", Tokens(s.prompt_len),  # type: ignore[arg-type]
                         cast(list[bytes], sim.hasher.hashes(s, s.prompt_len, sim.config.salt)
                              [:s.prompt_len // bs]), bs) for i, s in enumerate(specs)]
    gw = sim.gateway
    spent = {"lookup": 0.0, "fill": 0.0, "route": 0.0}
    for req in reqs:
        t0 = time.perf_counter()
        lookup = run_sync(gw.locality.lookup(req.block_hashes, gw.nodes))  # type: ignore[arg-type]
        t1 = time.perf_counter()
        filled = gw.locality.fill(req, lookup)
        t2 = time.perf_counter()
        gw.router.route(filled, gw.candidates())
        t3 = time.perf_counter()
        spent["lookup"] += t1 - t0
        spent["fill"] += t2 - t1
        spent["route"] += t3 - t2
    out = {k: round(v / max(1, len(reqs)) * 1e6, 1) for k, v in spent.items()}
    out["total"] = round(sum(out.values()), 1)
    return out


def run(args: argparse.Namespace) -> int:
    if args.gateway_process and (args.breakdown or args.pool_churn or args.profile):
        raise SystemExit("sim bench: --breakdown, --pool-churn and --profile time this "
                         "process's parts: not with --gateway-process")
    if args.gateway_process:
        args.route_sample = 0  # routing happened in the gateway's process
    prof = load_profile(args.hardware)
    if args.block_size:
        prof = with_block_size(prof, args.block_size)
    n_p = round(args.workers * args.prefill_share)
    cfg = ClusterConfig(prefill=n_p, decode=args.workers - n_p if n_p else 0,
                        colocated=0 if n_p else args.workers,
                        routing=routing_profile(args.routing, 0), itl_every=100,
                        gateway_process=args.gateway_process)
    scale = trace_rate(args.trace) / (args.rate_per_worker * args.workers)
    trace = mooncake(args.trace, limit=args.requests + args.route_sample, time_scale=scale,
                     repeat=0)
    marks: list[float] = []  # wall clock at each tenth of the requests' arrivals
    splits: list[dict[str, float]] = []  # --breakdown: its seconds at those marks
    tenth = max(1, args.requests // 10)
    # the box's L3 at each mark, the run paused (its time left out of the run's)
    l3 = memprobe.CacheProbe() if args.memprobe_mib else None
    l3_ns: list[float] = []
    paused: list[float] = []  # before each mark

    def timed(specs: Iterator[SimRequestSpec]) -> Iterator[SimRequestSpec]:
        for i, spec in enumerate(specs):
            if i % tenth == 0 and len(marks) < 10:
                t = time.perf_counter()
                if l3 is not None:
                    l3_ns.append(l3.sample())
                paused.append(time.perf_counter() - t)
                if acct is not None:
                    acct.leave_out(paused[-1])
                marks.append(time.perf_counter())
                if acct is not None:
                    splits.append(acct.snapshot())
            yield spec

    # the reference: this shared box's memory latency, which a late run at 16-token
    # blocks waits on, before and after it (in a process of its own)
    probes = [memprobe.measure_apart(region_mib=args.memprobe_mib)] if args.memprobe_mib else []
    # streamed: a million specs are not kept
    specs = timed(itertools.islice(trace, args.requests))
    sim = Simulator(cfg, prof)
    prof_run = cProfile.Profile() if args.profile else None
    acct = Accounting().install(sim) if args.breakdown else None
    in_run = RunPoolTimes().install(sim) if args.pool_churn else None
    t0 = time.perf_counter()
    if prof_run is not None:
        prof_run.enable()
    if acct is not None:
        acct.start()
    results = sim.run(specs)
    if acct is not None:
        acct.stop()
        splits.append(dict(acct.seconds))
    if prof_run is not None:
        prof_run.disable()
    end = time.perf_counter()
    wall = end - t0 - sum(paused)
    rate = len(results) / wall
    # The rate falls as a run ages (the pools fill, then every prompt evicts; memory
    # scatters): the projection takes the last tenth's rate, not the run's average.
    marks.append(end)
    paused.append(0.0)
    counts = [tenth] * (len(marks) - 2) + [len(results) - tenth * (len(marks) - 2)]
    tenths = [round(n / max(1e-9, b - a - p), 1)
              for n, a, b, p in zip(counts, marks[:-1], marks[1:], paused[1:], strict=True)]
    late = tenths[-2] if len(tenths) > 1 else rate  # the last tenth (the drain apart)
    projected = TARGET_REQUESTS / min(rate, late)
    ok = sum(r.ok for r in results)
    out = {"requests": len(results), "completed": ok, "workers": args.workers,
           "prefill_workers": n_p, "block_size": prof.block_size, "hardware": prof.name,
           "wall_s": round(wall, 2), "sim_requests_per_s": round(rate, 1),
           "events": sim.stats.events, "events_per_s": round(sim.stats.events / wall),
           "rate_by_tenth": tenths, "projected_1M_s": round(projected, 1),
           # the process's peak so far (Linux: KiB): the cluster's pools and the run's
           # state; a million requests must fit the machine too
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           # the interpreter's build moves these figures 12-25 % (Makefile: `PY`)
           "python": machine()["python"],
           "heap": arenas.heap(),  # what `splitserve sim` runs on (sim/arenas.py)
           "compiled": compiled_modules(),  # the sim's modules built by mypyc (sim/native.py)
           "gateway_process": args.gateway_process,
           "target_met": projected <= TARGET_S and args.workers >= TARGET_WORKERS}
    print(f"{len(results)} requests ({ok} completed) on {args.workers} simulated workers "
          f"(block size {prof.block_size}): {wall:.1f} s wall, {rate:.0f} simulated req/s, "
          f"{out['events_per_s']} events/s, peak RSS {out['peak_rss_mb']:,} MB (python "
          f"{out['python']}; {out['heap']}; "
          f"{'the gateway in its own process; ' if args.gateway_process else ''}"
          f"{'compiled: ' + ', '.join(out['compiled']) if out['compiled'] else 'interpreted'})")
    print("simulated req/s by tenth of the run: " + " ".join(f"{r:.0f}" for r in tenths))
    if isinstance(sim.gateway, RemoteGateway):  # how far the two processes overlapped
        out["waited_s"] = waits = {k: round(v, 2) for k, v in sim.gateway.waits.items()}
        print(f"the workers' process waited {waits['workers']:.1f} s for routes "
              f"({waits['workers'] / wall * 100:.0f} % of the run), the gateway's "
              f"{waits['gateway']:.1f} s for the workers' messages "
              f"({waits['gateway'] / wall * 100:.0f} %)")
    print(f"projected for {TARGET_REQUESTS:,} requests at the last tenth's rate: "
          f"{projected:.0f} s (target {TARGET_S:.0f} s on {TARGET_WORKERS} workers; the "
          "rate goes on falling past a short run: measure the million to know)")
    if acct is not None:
        out["breakdown_us"] = split = acct.per_request_us(len(results))
        floor = (split["engine"] + split["gateway"]) * 1e-6 * TARGET_REQUESTS
        out["production_1M_s"] = round(floor, 1)
        print("wall time per request: " + ", ".join(
            f"{k} {v:.0f} us ({v / max(1e-9, sum(split.values())) * 100:.0f} %)"
            for k, v in split.items()))
        print(f"the production code alone (engine + gateway) projects to {floor:.0f} s for "
              f"{TARGET_REQUESTS:,} requests (target {TARGET_S:.0f} s)")
        # per tenth: which part slows down as the run ages
        out["breakdown_us_by_tenth"] = by_tenth = [
            {k: round((b[k] - a[k]) / max(1, n) * 1e6, 1) for k in b}
            for n, a, b in zip(counts, splits[:-1], splits[1:], strict=True)]
        print("wall time per request by tenth (us), " + "/".join(split) + ": " + "  ".join(
            "/".join(f"{t[k]:.0f}" for k in split) for t in by_tenth))
    sample = list(trace)
    if sample:
        out["route_us"] = route_cost(sim, sample)
        print(f"gateway routing per request on the final state ({len(sample)} requests): "
              + ", ".join(f"{k} {v:.0f} us" for k, v in out["route_us"].items()))
    if in_run is not None:
        per_request = max(1, round(sum(r.prompt_len + (r.output_len or 0) for r in results)
                                   / max(1, len(results)) / prof.block_size))
        sim_blocks = next(iter(sim.workers.values())).kv.pool.num_blocks
        per_request = min(per_request, sim_blocks)
        n = max(1, 5_000_000 // per_request)  # 5M blocks: seconds
        cases = {"one_pool": pool_churn(1, sim_blocks, per_request, n),
                 "run_pools": pool_churn(args.workers, sim_blocks, per_request, n),
                 "in_run": in_run.per_block_ns()}
        out["pool_churn_ns"] = {"blocks_per_request": per_request, **{
            k: {step: round(v, 1) for step, v in c.items()} for k, c in cases.items()}}
        print(f"the block pool's steps per block, ns (take (evicting) / cache / free; a "
              f"prompt's {per_request} blocks, pools of {sim_blocks:,}):")
        for name, label in (("one_pool", "one pool, back to back"),
                            ("run_pools", f"{args.workers} pools, prompts between steps"),
                            ("in_run", "in this run")):
            c = cases[name]
            print(f"  {label}: " + " / ".join(f"{c[k]:.0f}" for k in STEPS)
                  + f" = {sum(c.values()):.0f} ns"
                  + ("" if name == "one_pool" else
                     f" ({sum(c.values()) / max(1e-9, sum(cases['one_pool'].values())):.1f}x"
                     " one pool's)"))
    if l3 is not None:
        out["l3_ns_by_tenth"] = l3_ns
        print(f"the box's L3 at the start of each tenth (ns a load from {l3.cache_mib} MiB, "
              "the run paused): " + " ".join(f"{x:.0f}" for x in l3_ns))
    if probes:
        probes.append(memprobe.measure_apart(region_mib=args.memprobe_mib))
        out["memory"] = dict(zip(("before", "after"), probes, strict=True))
        print("the machine in the same run (bench/memprobe.py): " + "; ".join(
            f"{when}: {memprobe.describe(p) if p else 'not measured'}"
            for when, p in out["memory"].items()))
    if prof_run is not None:
        buf = io.StringIO()
        pstats.Stats(prof_run, stream=buf).sort_stats("tottime").print_stats(18)
        print(buf.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
