"""`splitserve sim run`: one workload on one simulated cluster, reported in `splitserve
bench run`'s format (bench/metrics.py summary, bench/report.py JSON + Markdown + plots)
plus what only a simulator sees: transfer volume by kind and per-worker load.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from bench.base import BenchError, RequestResult
from bench.datasets import LengthDist
from bench.metrics import by_tag, parse_slo, summarize
from bench.report import Report, write_report
from bench.runner import Phase
from gateway.routing.profile import RoutingProfile
from sim.cluster import Simulator
from sim.config import ClusterConfig
from sim.profile import HardwareProfile, load_profile, with_block_size
from sim.workload import SimRequestSpec, mooncake, shared_prefix, synthetic

MOONCAKE_TRACE = "/work/shared/data/mooncake/conversation_trace.jsonl"
ROUTING_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "bench", "profiles")
WORKLOADS = ("mooncake", "poisson", "bursty", "shared-prefix")


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", default="cpu", help="cpu | h100 | a profile JSON path")
    p.add_argument("--prefill", type=int, default=0)
    p.add_argument("--decode", type=int, default=0)
    p.add_argument("--colocated", type=int, default=None, help="default 2 without P/D")
    p.add_argument("--num-blocks", type=int, default=0, help="KV blocks per worker "
                   "(default: the profile's)")
    p.add_argument("--host-blocks", type=int, default=0, help="host DRAM tier, blocks")
    p.add_argument("--disk-blocks", type=int, default=0, help="disk tier, blocks")
    p.add_argument("--routing", default="cache_aware",
                   help="cache_aware | least_loaded | round_robin (bench/profiles) or YAML")
    p.add_argument("--max-in-flight", type=int, default=0,
                   help="the gateway's limit (0: its default, 32 per decode/colocated "
                        "worker and at least 256; -1: none)")
    p.add_argument("--block-size", type=int, default=0,
                   help="override the profile's (its pool keeps as many tokens)")
    p.add_argument("--seed", type=int, default=0)


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=WORKLOADS, default="mooncake")
    p.add_argument("--trace", default=MOONCAKE_TRACE)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--time-scale", type=float, default=1.0, help="trace seconds -> seconds")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per trace hash id")
    p.add_argument("--max-input-len", type=int, default=None)
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument("--rate", type=float, default=4.0, help="poisson/bursty/shared-prefix req/s")
    p.add_argument("--burstiness", type=float, default=4.0, help="bursty: CV of the gaps")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--groups", type=int, default=16, help="shared-prefix groups")
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--slo", default="", help="e.g. ttft=2,tpot=0.1 (seconds)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_cluster_arguments(p)
    add_workload_arguments(p)
    p.add_argument("--out-dir", default="sim-results")
    p.add_argument("--json", default=None)
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (arrivals replayed, simulated time) on stderr")


def routing_profile(name: str, seed: int) -> RoutingProfile:
    path = os.path.join(ROUTING_DIR, f"{name}.yaml") if not name.endswith(".yaml") else name
    if not os.path.isfile(path):
        raise BenchError(f"no routing profile {name!r} ({path})")
    prof = RoutingProfile.from_yaml(path)
    return prof if prof.seed is not None else RoutingProfile.from_dict(
        {**prof.to_dict(), "seed": seed})


def hardware(args: argparse.Namespace) -> HardwareProfile:
    prof = load_profile(args.hardware)
    return with_block_size(prof, args.block_size) if args.block_size else prof


def cluster_config(args: argparse.Namespace, **over: Any) -> ClusterConfig:
    colocated = args.colocated if args.colocated is not None else (
        0 if args.prefill or args.decode else 2)
    kw: dict[str, Any] = dict(
        prefill=args.prefill, decode=args.decode, colocated=colocated,
        num_blocks=args.num_blocks, host_blocks=args.host_blocks, disk_blocks=args.disk_blocks,
        routing=routing_profile(args.routing, args.seed), max_in_flight=args.max_in_flight,
        seed=args.seed,
        itl_every=max(1, args.requests // 20000))  # bounded memory on long runs
    kw.update(over)
    return ClusterConfig(**kw)


def workload(args: argparse.Namespace) -> Iterable[SimRequestSpec]:
    n = args.requests
    if args.workload == "mooncake":
        return mooncake(args.trace, limit=n, block_tokens=args.block_tokens,
                        time_scale=args.time_scale, max_input_len=args.max_input_len,
                        max_output_len=args.max_output_len, repeat=0)
    if args.workload == "shared-prefix":
        per = max(1, n // args.groups)
        return shared_prefix(args.groups, per, args.prefix_len, args.input_len,
                             args.output_len, args.rate, seed=args.seed)
    return synthetic(n, args.rate, LengthDist(mean=args.input_len),
                     LengthDist(mean=args.output_len),
                     burstiness=args.burstiness if args.workload == "bursty" else 1.0,
                     seed=args.seed)


@dataclass(slots=True)
class SimRun:
    """A simulated phase and what only a simulator sees (JSON-able `extras`: transfer
    volume, routing outcomes, per-worker load, the simulator's own speed)."""

    phase: Phase
    extras: dict[str, Any]
    wall_s: float


def sim_extras(sim: Simulator, phase: Phase, wall_s: float) -> dict[str, Any]:
    st = sim.stats
    makespan = phase.summary["duration_s"]
    workers = {w.worker_id: {"role": w.role, "requests": w.requests_done, "steps": w.steps,
                             "tokens_computed": w.tokens_computed,
                             "busy_frac": round(w.busy_s / makespan, 4),
                             "prefix_hit_rate": round(w.kv.prefix_hits / w.kv.prefix_queries, 4)
                             if w.kv.prefix_queries else 0.0}
               for w in sim.workers.values()}
    return {"transfer_bytes": dict(st.transfer_bytes), "remote_prefills": st.remote_prefills,
            "peer_fetches": st.peer_fetches, "peer_misses": st.peer_misses,
            "rejected": st.rejected, "stalled": st.stalled, "invalid": st.invalid,
            "events": st.events,
            # the KV geometry (the block-size experiment varies it)
            "block_size": sim.profile.block_size,
            "blocks_per_worker": next(iter(sim.workers.values())).kv.pool.num_blocks,
            "wall_s": round(wall_s, 3),
            "sim_requests_per_s": round(len(phase.results) / wall_s, 1), "workers": workers}


def simulate(config: ClusterConfig, profile: HardwareProfile, specs: Iterable[SimRequestSpec],
             name: str, slo: dict[str, float] | None = None,
             params: dict[str, Any] | None = None, label: str = "",
             progress: int | None = None) -> SimRun:
    """Runs one phase; the simulator (its pools, its index) is dropped afterwards.
    `progress`: a bar on stderr over that many arrivals (None: no bar)."""
    sim = Simulator(config, profile)
    t0 = time.perf_counter()
    if progress is not None:
        specs = _with_progress(sim, specs, progress, name)
    results = sim.run(specs)
    wall = time.perf_counter() - t0
    phase = phase_of(results, name, slo, params, label)
    return SimRun(phase, sim_extras(sim, phase, wall), wall)


def _with_progress(sim: Simulator, specs: Iterable[SimRequestSpec], total: int,
                   name: str) -> Iterator[SimRequestSpec]:
    """`specs` as the simulator draws them (one arrival at a time), counted on a bar
    that shows the simulated clock too; what is in flight at the end finishes after it."""
    from tqdm import tqdm

    with tqdm(total=total, desc=name, unit="req", file=sys.stderr,
              mininterval=1.0) as bar:
        for i, spec in enumerate(specs):
            if i % 1000 == 0:
                bar.set_postfix_str(f"simulated {sim.now:.0f} s", refresh=False)
            bar.update(1)
            yield spec


def phase_of(results: list[RequestResult], name: str, slo: dict[str, float] | None,
             params: dict[str, Any] | None = None, label: str = "") -> Phase:
    """bench's Phase over simulated results; the duration is the simulated makespan."""
    if not results:
        raise BenchError("the workload is empty")
    start = min(r.start_s for r in results)
    end = max(r.start_s + (r.e2e_s or 0.0) for r in results)
    dur = max(end - start, 1e-9)
    return Phase(name, "simulated arrivals", results, summarize(results, dur, slo),
                 by_tag(results, dur, slo), dict(params or {}), label or name)


def run(args: argparse.Namespace) -> int:
    try:
        prof = hardware(args)
        cfg = cluster_config(args)
        slo = parse_slo(args.slo) if args.slo else None
        res = simulate(cfg, prof, workload(args), "sim", slo,
                       progress=None if args.no_progress else args.requests)
    except (BenchError, ValueError) as e:
        print(f"error: {e}")
        return 2
    ex = res.extras
    s = res.phase.summary
    report = Report("sim-run", f"Simulated: {args.workload} on {cfg.prefill}P/{cfg.decode}D/"
                    f"{cfg.colocated}C ({prof.name})", [res.phase],
                    summary={"hit_rate": round(s["cached_ratio"], 4),
                             "ttft_p50": s["ttft_s"]["p50"], "tpot_p50": s["tpot_s"]["p50"],
                             "goodput_fraction": s.get("goodput_fraction"),
                             "sim_requests_per_s": ex["sim_requests_per_s"]},
                    config={"args": {k: v for k, v in vars(args).items()
                                     if not k.startswith("_")}, "sim": ex,
                            "hardware": prof.name},
                    notes=[f"transfer bytes: {ex['transfer_bytes']}",
                           f"simulated {len(res.phase.results)} requests in "
                           f"{res.wall_s:.1f} s wall ({ex['sim_requests_per_s']} req/s)"])
    paths = write_report(report, args.out_dir, args.json)
    print(f"{s['completed']}/{s['requests']} completed; TTFT p50 {s['ttft_s']['p50']}, "
          f"TPOT p50 {s['tpot_s']['p50']}, hit rate {s['cached_ratio']:.3f}; "
          f"{ex['sim_requests_per_s']} simulated req/s; report {paths['markdown']}")
    return 0
