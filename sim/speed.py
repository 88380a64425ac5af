"""`splitserve sim bench`: how fast the simulator itself runs. Replays the Mooncake trace
(repeated past its end when more requests are asked for) on W simulated workers at a
given load per worker, at the trace's 512-token blocks unless `--block-size` says
otherwise, and prints simulated requests per wall second, per tenth of the run too, and
what the slower of the run's rate and its last tenth's projects for the target: one
million requests over 512 workers in under ten minutes. The rate falls as a run ages
(the pools fill, then every prompt evicts), so a short run's average overstates the
million.
`--profile` prints the hot path (cProfile, top functions by own time).

It also times the gateway's routing of one request on the cluster the run left behind
(the production Locality and Router; the in-process index standing in for Redis): the
next `--route-sample` requests of the trace, each looked up, filled and routed (nothing
is sent), in microseconds per request.

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
from collections.abc import Iterator
from typing import cast

from bench.report import machine
from sim.accounting import Accounting
from sim.cluster import Simulator
from sim.config import ClusterConfig
from sim.gateway import run_sync
from sim.profile import load_profile, with_block_size
from sim.request import Tokens
from sim.run_cli import MOONCAKE_TRACE, routing_profile
from sim.workload import MOONCAKE_BLOCK_TOKENS, SimRequestSpec, mooncake, trace_rate

TARGET_REQUESTS, TARGET_WORKERS, TARGET_S = 1_000_000, 512, 600.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--prefill-share", type=float, default=0.0,
                   help="fraction of workers in the prefill pool (0: all colocated)")
    p.add_argument("--rate-per-worker", type=float, default=0.5, help="req/s per worker")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--block-size", type=int, default=MOONCAKE_BLOCK_TOKENS,
                   help="KV blocks of this many tokens, the profile's pool keeping as many "
                        "tokens (default: the trace's own blocks; 0: the profile's)")
    p.add_argument("--routing", default="cache_aware")
    p.add_argument("--trace", default=MOONCAKE_TRACE)
    p.add_argument("--profile", action="store_true", help="cProfile the run")
    p.add_argument("--breakdown", action="store_true",
                   help="split the wall time: engine, gateway, index, simulator "
                        "(sim/accounting.py; ~1 us per wrapped call)")
    p.add_argument("--route-sample", type=int, default=500,
                   help="requests routed again after the run to time routing (0: skip)")
    p.add_argument("--json", default=None)


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
    prof = load_profile(args.hardware)
    if args.block_size:
        prof = with_block_size(prof, args.block_size)
    n_p = round(args.workers * args.prefill_share)
    cfg = ClusterConfig(prefill=n_p, decode=args.workers - n_p if n_p else 0,
                        colocated=0 if n_p else args.workers,
                        routing=routing_profile(args.routing, 0), itl_every=100)
    scale = trace_rate(args.trace) / (args.rate_per_worker * args.workers)
    trace = mooncake(args.trace, limit=args.requests + args.route_sample, time_scale=scale,
                     repeat=0)
    # wall clock at the run's start and at each later tenth of the requests' arrivals
    marks: list[float] = []
    cpu_marks: list[float] = []  # and this process's CPU time
    splits: list[dict[str, float]] = []  # --breakdown: its seconds at those marks
    tenth = max(1, args.requests // 10)

    def timed(specs: Iterator[SimRequestSpec]) -> Iterator[SimRequestSpec]:
        for i, spec in enumerate(specs):
            if i and i % tenth == 0 and len(marks) < 10:
                marks.append(time.perf_counter())
                cpu_marks.append(time.process_time())
                if acct is not None:
                    splits.append(acct.snapshot())
            yield spec

    # streamed: a million specs are not kept
    specs = timed(itertools.islice(trace, args.requests))
    sim = Simulator(cfg, prof)
    prof_run = cProfile.Profile() if args.profile else None
    acct = Accounting().install(sim) if args.breakdown else None
    t0, cpu0 = time.perf_counter(), time.process_time()
    if prof_run is not None:
        prof_run.enable()
    if acct is not None:
        acct.start()
    # the first tenth from the run's start: the tenths cover all of it, set-up included
    marks.append(time.perf_counter())
    cpu_marks.append(time.process_time())
    if acct is not None:
        splits.append(acct.snapshot())
    results = sim.run(specs)
    if acct is not None:
        acct.stop()
        splits.append(dict(acct.seconds))
    if prof_run is not None:
        prof_run.disable()
    end, cpu_end = time.perf_counter(), time.process_time()
    wall, cpu = end - t0, cpu_end - cpu0
    rate = len(results) / wall
    # The rate falls as a run ages (the pools fill, then every prompt evicts): the
    # projection takes the last tenth's rate, not the run's average.
    marks.append(end)
    counts = [tenth] * (len(marks) - 2) + [len(results) - tenth * (len(marks) - 2)]
    tenths = [round(n / max(1e-9, b - a), 1)
              for n, a, b in zip(counts, marks[:-1], marks[1:], strict=True)]
    late = tenths[-2] if len(tenths) > 1 else rate  # the last tenth (the drain apart)
    projected = TARGET_REQUESTS / min(rate, late)
    # The same in CPU seconds: what the run took of the core it ran on, which on a
    # shared machine (other processes taking turns on its cores) is the steadier figure.
    cpu_marks.append(cpu_end)
    cpu_tenths = [round(n / max(1e-9, b - a), 1)
                  for n, a, b in zip(counts, cpu_marks[:-1], cpu_marks[1:], strict=True)]
    cpu_rate = len(results) / max(1e-9, cpu)
    cpu_late = cpu_tenths[-2] if len(cpu_tenths) > 1 else cpu_rate
    projected_cpu = TARGET_REQUESTS / min(cpu_rate, cpu_late)
    ok = sum(r.ok for r in results)
    out = {"requests": len(results), "completed": ok, "workers": args.workers,
           "prefill_workers": n_p, "block_size": prof.block_size, "hardware": prof.name,
           "wall_s": round(wall, 2), "sim_requests_per_s": round(rate, 1),
           "events": sim.stats.events, "events_per_s": round(sim.stats.events / wall),
           "rate_by_tenth": tenths, "projected_1M_s": round(projected, 1),
           "cpu_s": round(cpu, 3), "cpu_rate_by_tenth": cpu_tenths,
           "projected_1M_cpu_s": round(projected_cpu, 1),
           # the process's peak so far (Linux: KiB): the cluster's pools and the run's
           # state; a million requests must fit the machine too
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           "machine": machine(),
           "target_met": projected <= TARGET_S and args.workers >= TARGET_WORKERS}
    print(f"{len(results)} requests ({ok} completed) on {args.workers} simulated workers "
          f"(block size {prof.block_size}): {wall:.1f} s wall, {rate:.0f} simulated req/s, "
          f"{out['events_per_s']} events/s, peak RSS {out['peak_rss_mb']:,} MB "
          f"({out['machine']['cpus']} CPUs, {out['machine']['cpu_model']}; python "
          f"{out['machine']['python']})")
    print("simulated req/s by tenth of the run: " + " ".join(f"{r:.0f}" for r in tenths))
    print(f"CPU time {cpu:.1f} s ({cpu / max(1e-9, wall) * 100:.0f} % of the wall time); "
          "simulated req/s per CPU second by tenth: "
          + " ".join(f"{r:.0f}" for r in cpu_tenths))
    print(f"projected for {TARGET_REQUESTS:,} requests at the last tenth's rate: "
          f"{projected:.0f} s (target {TARGET_S:.0f} s on {TARGET_WORKERS} workers; the "
          f"rate goes on falling past a short run: measure the million to know); "
          f"{projected_cpu:.0f} CPU seconds at the last tenth's rate per CPU second")
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
    if prof_run is not None:
        buf = io.StringIO()
        pstats.Stats(prof_run, stream=buf).sort_stats("tottime").print_stats(18)
        print(buf.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
