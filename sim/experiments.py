"""`splitserve sim experiment NAME`: the questions a 2-core machine cannot answer by
running the cluster, answered on simulated H100s (sim/profiles/h100.json: the roofline
fitted from `bench engine --device cuda` on an H100; links assumed) serving llama3-8b,
the Mooncake conversation trace as load.

- `routing`: round-robin vs least-loaded vs cache-aware (bench/profiles) as the load
  rises to saturation: TTFT, goodput under the SLO, prefix hit rate.
- `pd-ratio`: at a fixed GPU count, every prefill:decode split and all-colocated: the
  goodput under a TTFT/TPOT SLO (DistServe's question), as the load rises.
- `tiers`: by device cache size, the hit rate and TTFT with host and disk tiers behind
  the device, and the value of peer fetch between decode workers.
- `block-size`: the same cluster and load with the KV memory in blocks of 16 to 512
  tokens (the same tokens each): what coarser blocks change in the answers, against
  how much faster they simulate (a scale run's choice: sim bench, docs/results.md).

Each writes `sim-NAME.{json,md}` and plots (bench/report.py's format) into --out-dir.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from bench.base import BenchError
from bench.metrics import parse_slo
from bench.plots import available as plots_available
from bench.report import Report, write_report
from bench.routing_bench import sample_trace
from gateway.routing.profile import RoutingProfile
from sim.config import ClusterConfig
from sim.headlines import (
    block_size_headline,
    metric_plot,
    pd_headline,
    routing_headline,
    tiers_headline,
)
from sim.profile import HardwareProfile, load_profile, with_block_size
from sim.run_cli import MOONCAKE_TRACE, SimRun, routing_profile, simulate
from sim.workload import MOONCAKE_BLOCK_TOKENS, mooncake, trace_rate

EXPERIMENTS = ("routing", "pd-ratio", "tiers", "block-size")
BLOCK_SIZES = (16, 32, 64, 128, 256, 512)  # the first: the reference the others are held to
RESEEDS = 2  # the reference again with other seeds: the spread of chance


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=EXPERIMENTS)
    p.add_argument("--hardware", default="h100")
    p.add_argument("--trace", default=MOONCAKE_TRACE)
    p.add_argument("--requests", type=int, default=1200, help="trace records per phase")
    p.add_argument("--workers", type=int, default=8, help="GPUs in the cluster")
    p.add_argument("--rates", default="", help="req/s per GPU, comma-separated")
    p.add_argument("--slo", default="ttft=2,tpot=0.08")
    p.add_argument("--out-dir", default="docs/results")
    p.add_argument("--sample", type=int, default=10,
                   help="keep every N-th conversation of the trace (all its turns), as "
                        "bench routing does: a phase spans more of the trace's reuse")
    p.add_argument("--block-size", type=int, default=None,
                   help="the profile's KV memory in blocks of this many tokens (default "
                        f"{MOONCAKE_BLOCK_TOKENS}: the trace's own blocks; 0: the profile's; "
                        "the block-size experiment sets its own)")
    p.add_argument("--max-in-flight", type=int, default=0,
                   help="the gateway's limit, 429 beyond (0: its default, 32 per "
                        "decode/colocated worker and at least 256; -1: none)")
    p.add_argument("--peer-rate", type=float, default=0.5,
                   help="tiers: req/s per GPU of the peer-fetch phases (1:3 prefill:decode)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="phases simulated at once, one process each (default: one per CPU)")


def run(args: argparse.Namespace) -> int:
    prof = load_profile(args.hardware)
    if args.name == "block-size":
        if args.block_size is not None:
            raise BenchError("the block-size experiment sets the block size of each phase: "
                             "drop --block-size")
    elif args.block_size is None:
        prof = with_block_size(prof, MOONCAKE_BLOCK_TOKENS)
    elif args.block_size:
        prof = with_block_size(prof, args.block_size)
    slo = parse_slo(args.slo)
    rates = [float(r) for r in args.rates.split(",") if r] or DEFAULT_RATES[args.name]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        args.sampled = sample_trace(args.trace, args.sample, args.requests,
                                    os.path.join(tmp, "trace.jsonl"))
        with open(args.sampled) as f:
            kept = sum(1 for _ in f)
        whole = args.sample == 1 and kept < args.requests  # every record of the trace
        args.requests = kept
        runs = run_jobs(args, prof, slo, RUNNERS[args.name](args, prof, rates))
    wall = time.perf_counter() - t0
    phases = [r.phase for r in runs]
    summary = HEADLINES[args.name](runs)
    n = sum(len(p.results) for p in phases)
    sample = "the whole trace" if whole else \
        f"{args.requests} records of every {_nth(args.sample)} conversation, all its turns"
    # one report per scale (the default 8 GPUs keep the plain name) and for the whole trace
    name = f"sim-{args.name}" + (f"-{args.workers}gpu" if args.workers != 8 else "") \
        + ("-full" if whole else "")
    report = Report(
        name, TITLES[args.name].format(w=args.workers, hw=prof.name), phases,
        summary=summary,
        config={"hardware": prof.name, "model": prof.model_shape if not prof.model else "",
                "workers": args.workers, "requests_per_phase": args.requests,
                "trace_sample": sample,
                "rates_per_gpu": rates, "slo": slo, "trace": os.path.basename(args.trace),
                "block_size": "per phase" if args.name == "block-size" else prof.block_size,
                "max_in_flight": args.max_in_flight or "the gateway's default (32 per "
                                 "decode/colocated worker, at least 256)",
                "phases": {p.name: {k: v for k, v in r.extras.items() if k != "workers"}
                           for p, r in zip(phases, runs, strict=True)}},
        notes=[f"Simulated ({prof.name} profile: {prof.source}); {n} requests in "
               f"{wall:.0f} s of wall time.",
               *(note.format(sample=sample) for note in NOTES[args.name])])
    paths = write_report(report, args.out_dir)
    extra = metric_plot(phases, os.path.join(args.out_dir, f"{name}-goodput.png"),
                        report.title) if plots_available() else None
    _finish_json(paths["json"][0], extra)
    if extra:
        with open(paths["markdown"], "a") as f:
            f.write(f"\n![goodput]({os.path.basename(extra)})\n")
    for k, v in summary.items():
        print(f"{k}: {v}")
    print(f"report: {paths['markdown']}")
    return 0


def _finish_json(path: str, extra_plot: str | None) -> None:
    """Keeps the JSON to summaries (a phase holds thousands of requests) and lists the
    goodput plot with the others (the results page shows them)."""
    with open(path) as f:
        data = json.load(f)
    for p in data["phases"]:
        p.pop("requests", None)
    if extra_plot:
        data["plots"].insert(0, os.path.basename(extra_plot))
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def _trace(args: argparse.Namespace, rate_per_gpu: float) -> Any:
    scale = trace_rate(args.sampled, args.requests) / (rate_per_gpu * args.workers)
    return mooncake(args.sampled, limit=args.requests, time_scale=scale)


@dataclass(frozen=True)
class Job:
    """One phase: a cluster, a load (req/s per GPU) and the phase's labels."""

    cfg: ClusterConfig
    rate: float
    config: str
    params: dict[str, Any] = field(default_factory=dict)
    block_size: int = 0  # the profile's KV memory in blocks of this many tokens (0: as is)


def _job(cfg: ClusterConfig, rate: float, config: str, block_size: int = 0,
         **params: Any) -> Job:
    return Job(cfg, rate, config, params, block_size)


def _run(args: argparse.Namespace, prof: HardwareProfile, slo: dict[str, float],
         job: Job) -> SimRun:
    name = f"{job.config} @ {job.rate:g}/GPU"
    print(f"  {name}...", flush=True)
    if job.block_size:
        prof = with_block_size(prof, job.block_size)
    return simulate(replace(job.cfg, seed=args.seed, itl_every=10,
                            max_in_flight=args.max_in_flight),
                    prof, _trace(args, job.rate), name, slo,
                    {"rate": job.rate * args.workers, **job.params}, job.config)


def run_jobs(args: argparse.Namespace, prof: HardwareProfile, slo: dict[str, float],
             jobs: list[Job]) -> list[SimRun]:
    """The phases, `args.jobs` at a time in worker processes (each is its own seeded
    simulation: the results do not depend on how many run at once), in order."""
    run_one = partial(_run, args, prof, slo)
    if args.jobs <= 1 or len(jobs) <= 1:
        return [run_one(j) for j in jobs]
    with ProcessPoolExecutor(max_workers=min(args.jobs, len(jobs)),
                             mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(run_one, jobs))


# -- routing ---------------------------------------------------------------------------
def routing(args: argparse.Namespace, prof: HardwareProfile, rates: list[float]) -> list[Job]:
    out = []
    for rate in rates:
        for name in ("round_robin", "least_loaded", "cache_aware"):
            cfg = ClusterConfig(colocated=args.workers, routing=routing_profile(name, args.seed))
            out.append(_job(cfg, rate, name))
    return out


# -- pd-ratio ----------------------------------------------------------------------------
def pd_ratio(args: argparse.Namespace, prof: HardwareProfile, rates: list[float]) -> list[Job]:
    """All-colocated, then every prefill:decode split (past 8 GPUs: in eighths)."""
    w = args.workers
    out = []
    routing = RoutingProfile(seed=args.seed)
    for rate in rates:
        out.append(_job(ClusterConfig(colocated=w, routing=routing), rate, f"colocated {w}"))
        for p in range(max(1, w // 8), w, max(1, w // 8)):
            cfg = ClusterConfig(prefill=p, decode=w - p, colocated=0, routing=routing)
            out.append(_job(cfg, rate, f"{p}P:{w - p}D", prefill=p))
    return out


# -- tiers -------------------------------------------------------------------------------
FRACTIONS = (8, 4, 2)  # the device caches: 1/8, 1/4, 1/2 of the profile's


def tiers(args: argparse.Namespace, prof: HardwareProfile, rates: list[float]) -> list[Job]:
    """Device caches of 1/8, 1/4 and 1/2 of an H100's; behind each: nothing, a host
    tier of 4x the device, host + disk (16x). Then, at each of those caches, peer fetch
    on and off in a 1:3 prefill:decode split at `--peer-rate` (below that split's
    prefill saturation, where a fetch's saving can show: at 1 req/s per GPU its
    TTFT p90 runs to tens of seconds on the Mooncake trace)."""
    w, rate = args.workers, rates[0]
    out = []
    routing = routing_profile("cache_aware", args.seed)
    for frac in FRACTIONS:
        nb = prof.num_blocks // frac
        for label, host, disk in (("device", 0, 0), ("+host", 4 * nb, 0),
                                  ("+host+disk", 4 * nb, 16 * nb)):
            cfg = ClusterConfig(colocated=w, num_blocks=nb, host_blocks=host,
                                disk_blocks=disk, routing=routing)
            out.append(_job(cfg, rate, f"{label} 1/{frac}", device_blocks=nb))
    pd = RoutingProfile.from_dict({**RoutingProfile().to_dict(), "seed": args.seed})
    for frac in FRACTIONS:
        nb = prof.num_blocks // frac
        for label, need in (("peer fetch", 2), ("no peer fetch", 0)):
            cfg = ClusterConfig(prefill=w // 4, decode=w - w // 4, colocated=0, num_blocks=nb,
                                routing=replace(pd, peer_fetch_min_blocks=need))
            out.append(_job(cfg, args.peer_rate, f"{label} 1/{frac}", device_blocks=nb,
                            rate_per_gpu=args.peer_rate))
    return out


# -- block-size --------------------------------------------------------------------------
def block_size(args: argparse.Namespace, prof: HardwareProfile,
               rates: list[float]) -> list[Job]:
    """Colocated, cache-aware; per rate, one phase per block size (the same tokens of KV
    memory: with_block_size), then the reference size again with the pickers reseeded
    (their ties broken otherwise): how far an answer moves for no reason of the model's,
    the yardstick of the other sizes' moves."""
    phases = [(bs, 0) for bs in BLOCK_SIZES] \
        + [(BLOCK_SIZES[0], k) for k in range(1, RESEEDS + 1)]
    return [_job(ClusterConfig(colocated=args.workers,
                               routing=routing_profile("cache_aware", args.seed + k)),
                 rate, f"{bs}-token blocks" + (f", seed +{k}" if k else ""),
                 block_size=bs, block_tokens=bs, reseeded=k)
            for rate in rates for bs, k in phases]


def _nth(n: int) -> str:
    if n == 1:
        return "single"
    return f"{n}" + ("th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th"))


DEFAULT_RATES = {"routing": [0.5, 1.0, 2.0, 3.0, 4.0], "pd-ratio": [1.0, 2.0],
                 "tiers": [1.0], "block-size": [1.0, 2.0]}
RUNNERS: dict[str, Callable[..., list[Job]]] = {
    "routing": routing, "pd-ratio": pd_ratio, "tiers": tiers, "block-size": block_size}
HEADLINES: dict[str, Callable[[list[SimRun]], dict[str, Any]]] = {
    "routing": routing_headline, "pd-ratio": pd_headline, "tiers": tiers_headline,
    "block-size": block_size_headline}
TITLES = {"routing": "Simulated routing profiles on {w} {hw} GPUs, Mooncake trace",
          "pd-ratio": "Simulated prefill:decode splits of {w} {hw} GPUs, Mooncake trace",
          "tiers": "Simulated KV tiers and peer fetch on {w} {hw} GPUs, Mooncake trace",
          "block-size": "Simulated KV block sizes on {w} {hw} GPUs, Mooncake trace"}
NOTES = {
    "routing": ["Rates are the whole cluster's; each phase replays the same records "
                "({sample}), time-scaled to that mean rate.",
                "goodput: fraction of requests meeting TTFT <= 2 s and TPOT <= 80 ms "
                "(429s count as misses); hit_rate: cached prompt tokens / prompt tokens."],
    "pd-ratio": ["Disaggregated configs use the gateway's default routing (prefix locality, "
                 "queue, KV usage; threshold decider at 256 uncached tokens).",
                 "stalled: requests a decode worker's scheduler never ran (a deadlock: a "
                 "preempted long prompt heading the waiting line with too few free blocks, "
                 "while requests whose remote KV had landed held the rest behind it; the "
                 "first run of this experiment stalled up to 256 requests per config, and "
                 "engine/scheduler.py now admits requests that hold their KV past such a "
                 "head). 0 everywhere since."],
    "tiers": ["Device cache sizes are fractions of the profile's KV blocks per GPU, so that "
              "the trace's reuse outgrows the device; a prompt that needs more blocks than "
              "the device has is refused (400), as the engine refuses it."],
    "block-size": ["Each block size keeps the profile's KV memory (as many tokens: the pool "
                   "in blocks of that size), colocated workers, cache-aware routing; the "
                   "trace's prefixes are shared in its 512-token hash blocks at every size.",
                   "`vs 16`: how far each answer moved from the 16-token phase's (the "
                   "engine's block size); `16 reseeded`: how far it moved at 16-token "
                   "blocks with the pickers' seed changed (ties broken otherwise): a move "
                   "of that size is chance, not the block size. Simulated req/s: the "
                   "simulator's own speed (the phases run --jobs at a time on this "
                   "machine), against the 16-token phase's."],
}
