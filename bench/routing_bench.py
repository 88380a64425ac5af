"""`splitserve bench routing`: one cluster (3 colocated workers by default), the same
workload replayed under the round-robin, least-loaded and cache-aware routing profiles
(bench/profiles/*.yaml), swapped at run time through the gateway's admin API.

Every phase starts cold: its requests carry a `cache_salt` of their own, so no block
cached by an earlier phase (or the warm-up) matches (the salt is part of every block
hash: engine prefix cache, Redis index and router alike). Workloads: shared-prefix groups
(shuffled, so the rotation of round-robin cannot line up with the groups by chance) and
the Mooncake conversation trace (each hash id -> a block of tokens derived from the id;
optionally every N-th conversation only, which keeps the trace's reuse structure at a
fraction of its size). Figures per profile: prefix hit rate (cached prompt tokens /
prompt tokens, from `usage.prompt_tokens_details.cached_tokens`), TTFT p50/p90 and
throughput, next to the workload's infinite-cache ceiling.

Ownership: the benchmark owns the cluster it starts (stopped before it returns) and the
sampled trace file it writes under `--out-dir`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from bench.base import BenchError, BenchRequest
from bench.clients import OpenAIClient
from bench.datasets import mooncake, shared_prefix
from bench.experiments.common import ExperimentConfig, measure, phase_kw, pick, start_cluster
from bench.experiments.routing import MOONCAKE_TRACE, ideal_cached_ratio
from bench.load import LoadSpec
from bench.report import Report
from bench.runner import Phase, run_phase

PROFILES = ("round_robin", "least_loaded", "cache_aware")
PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
WORKLOADS = ("shared-prefix", "mooncake")
TARGET_HIT = 0.8  # cache_aware hit rate >= 0.8x the ceiling
TARGET_TTFT = 0.5  # cache_aware TTFT p50 <= 0.5x round_robin's


@dataclass(frozen=True, slots=True)
class RoutingBenchConfig:
    """The workloads and the cluster size (the CLI's flags; `quick()` for the tests)."""

    workers: int = 3
    workload: str = "both"  # shared-prefix | mooncake | both
    trace_path: str = MOONCAKE_TRACE
    records: int = 300  # trace records replayed, at most (after sampling)
    trace_sample: int = 40  # keep every N-th conversation of the trace (1: all)
    block_tokens: int = 16  # prompt tokens per trace hash id
    time_scale: float = 0.01  # trace seconds -> replay seconds
    max_input_len: int = 1800
    max_output_len: int = 8
    groups: int = 12  # shared-prefix: groups x per_group requests
    per_group: int = 4
    prefix_len: int = 1024
    suffix_len: int = 32
    output_len: int = 8
    rate: float = 4.0  # shared-prefix Poisson arrivals, req/s
    block_size: int = 16  # the workers' KV block size (for the ceiling)

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise BenchError("routing needs at least 2 workers to choose from")
        if self.workload not in (*WORKLOADS, "both"):
            raise BenchError(f"--workload must be one of {WORKLOADS} or both, "
                             f"got {self.workload!r}")
        if "mooncake" in self.workloads and not os.path.isfile(self.trace_path):
            raise BenchError(f"Mooncake trace {self.trace_path!r} does not exist "
                             "(--trace PATH, or --workload shared-prefix)")
        ints = (self.records, self.trace_sample, self.block_tokens, self.max_input_len,
                self.max_output_len, self.groups, self.per_group, self.prefix_len,
                self.suffix_len, self.output_len, self.block_size)
        if min(ints) < 1:
            raise BenchError("counts and lengths must be >= 1")
        if self.time_scale < 0 or not self.rate > 0:
            raise BenchError("need --time-scale >= 0 and --rate > 0")

    @property
    def workloads(self) -> tuple[str, ...]:
        return WORKLOADS if self.workload == "both" else (self.workload,)

    def quick(self) -> RoutingBenchConfig:
        """A few-second version: small groups and a handful of trace records."""
        return replace(self, records=min(self.records, 8), trace_sample=1, time_scale=0.0,
                       max_input_len=256, max_output_len=2, groups=4, per_group=3,
                       prefix_len=64, suffix_len=8, output_len=2, rate=8.0)


def sample_trace(path: str, every: int, limit: int, out_path: str) -> str:
    """Writes to `out_path` the first `limit` records of `path` whose conversation (its
    first two hash ids: the shared system block and the conversation's own first block)
    is every `every`-th conversation in order of appearance. A sampled conversation keeps
    all its turns, so the reuse between turns survives the sampling."""
    convs: dict[tuple[int, ...], int] = {}
    kept: list[str] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if len(kept) >= limit:
                break
            if not line.strip():
                continue
            try:
                key = tuple(int(h) for h in json.loads(line)["hash_ids"][:2])
            except (ValueError, KeyError, TypeError) as e:
                raise BenchError(f"{path}:{lineno}: not a Mooncake record ({e})") from e
            ordinal = convs.setdefault(key, len(convs))
            if ordinal % every == 0:
                kept.append(line.rstrip("\n"))
    if not kept:
        raise BenchError(f"{path}: no records")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        f.write("\n".join(kept) + "\n")
    return out_path


def build_workloads(bcfg: RoutingBenchConfig, cfg: ExperimentConfig,
                    ) -> dict[str, tuple[list[BenchRequest], LoadSpec]]:
    from bench.experiments.common import tokens

    pool = tokens(cfg)
    out: dict[str, tuple[list[BenchRequest], LoadSpec]] = {}
    if "shared-prefix" in bcfg.workloads:
        reqs = shared_prefix(pool, bcfg.groups, bcfg.per_group, bcfg.prefix_len,
                             bcfg.suffix_len, bcfg.output_len, cfg.seed)
        random.Random(cfg.seed).shuffle(reqs)
        out["shared-prefix"] = (reqs, LoadSpec("poisson", rate=bcfg.rate, seed=cfg.seed))
    if "mooncake" in bcfg.workloads:
        trace = sample_trace(bcfg.trace_path, bcfg.trace_sample, bcfg.records,
                             os.path.join(cfg.out_dir, "bench-routing-trace.jsonl"))
        reqs = mooncake(trace, pool, block_tokens=bcfg.block_tokens,
                        time_scale=bcfg.time_scale, max_output_len=bcfg.max_output_len,
                        max_input_len=bcfg.max_input_len)
        out["mooncake"] = (reqs, LoadSpec("trace"))
    return out


class SaltedClient(OpenAIClient):
    """The OpenAI client with a `cache_salt` on every request: a phase of its own."""

    def __init__(self, url: str, salt: str, timeout_s: float, token_chunks: bool = False
                 ) -> None:
        super().__init__(url, timeout_s=timeout_s, token_chunks=token_chunks)
        self.salt = salt

    def body(self, req: BenchRequest) -> dict[str, Any]:
        return {**super().body(req), "cache_salt": self.salt}


def profile_path(name: str) -> str:
    return os.path.join(PROFILE_DIR, f"{name}.yaml")


def set_profile(url: str, admin_key: str, name: str) -> None:
    """POSTs bench/profiles/<name>.yaml to the gateway's admin API and checks that the
    live profile is now that one."""
    from gateway.routing.profile import RoutingProfile

    path = profile_path(name)
    want = RoutingProfile.from_yaml(path).to_dict()
    with open(path, "rb") as f:
        body = f.read()
    req = urllib.request.Request(url + "/admin/v1/routing", data=body, method="POST",
                                 headers={"Authorization": f"Bearer {admin_key}",
                                          "Content-Type": "application/yaml"})
    try:
        with urllib.request.urlopen(req, timeout=5.0) as r:
            live = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise BenchError(f"the gateway refused routing profile {name!r}: {e}") from e
    if live != want:
        raise BenchError(f"the gateway runs {live!r}, not profile {name!r} ({want!r})")


def run_phases(cfg: ExperimentConfig, url: str, admin_key: str,
               work: dict[str, tuple[list[BenchRequest], LoadSpec]],
               ) -> Callable[[OpenAIClient], Awaitable[list[Phase]]]:
    """The measured body: each workload under each profile, one salt per phase."""
    run_id = secrets.token_hex(4)

    async def body(_: OpenAIClient) -> list[Phase]:
        phases = []
        for w, (reqs, load) in work.items():
            for prof in PROFILES:
                await asyncio.to_thread(set_profile, url, admin_key, prof)
                client = SaltedClient(url, f"bench-routing-{run_id}-{w}-{prof}",
                                      cfg.request_timeout_s)
                try:
                    phases.append(await run_phase(
                        client, reqs, load, name=f"{prof} / {w}", config=prof,
                        params={"workload": w}, **phase_kw(cfg)))
                finally:
                    await client.close()
        return phases

    return body


def summarize(phases: list[Phase], work: dict[str, tuple[list[BenchRequest], LoadSpec]],
              block_size: int) -> dict[str, Any]:
    """Keys `<figure>_<profile>_<workload>` for every workload, and the same without the
    workload suffix for the headline one (the Mooncake trace when it ran)."""
    s: dict[str, Any] = {}
    for w, (reqs, _) in work.items():
        k = w.replace("-", "_")
        s[f"hit_ceiling_{k}"] = round(ideal_cached_ratio(reqs, block_size), 4)
        for p in (p for p in phases if p.params["workload"] == w):
            s[f"hit_rate_{p.config}_{k}"] = round(p.summary["cached_ratio"], 4)
            s[f"ttft_p50_{p.config}_{k}"] = pick(p.summary, "ttft_s", "p50")
            s[f"ttft_p90_{p.config}_{k}"] = pick(p.summary, "ttft_s", "p90")
            s[f"throughput_{p.config}_{k}"] = round(p.summary["request_throughput"], 3)
            s[f"output_tok_s_{p.config}_{k}"] = round(p.summary["output_throughput"], 1)
        ceiling, hit = s[f"hit_ceiling_{k}"], s.get(f"hit_rate_cache_aware_{k}")
        rr, ca = s.get(f"ttft_p50_round_robin_{k}"), s.get(f"ttft_p50_cache_aware_{k}")
        s[f"hit_vs_ceiling_{k}"] = round(hit / ceiling, 3) if hit is not None and ceiling \
            else None
        s[f"ttft_vs_round_robin_{k}"] = round(ca / rr, 3) if ca and rr else None
    headline = "mooncake" if "mooncake" in work else "shared_prefix"
    for key, v in list(s.items()):
        if key.endswith(f"_{headline}"):
            s[key.removesuffix(f"_{headline}")] = v
    s["headline_workload"] = headline.replace("_", "-")
    s["failed_requests"] = sum(p.summary["failed"] for p in phases)
    return s


def target_lines(s: dict[str, Any], workloads: list[str]) -> list[str]:
    """The targets, per workload: met or missed, and by how much."""
    out = []
    for w in workloads:
        k = w.replace("-", "_")
        hv, tv = s[f"hit_vs_ceiling_{k}"], s[f"ttft_vs_round_robin_{k}"]
        hit = (f"hit rate {s[f'hit_rate_cache_aware_{k}']:.1%} = "
               + (f"{hv:.2f}x" if hv is not None else "-")
               + f" the ceiling {s[f'hit_ceiling_{k}']:.1%} (target >= {TARGET_HIT}x: "
               + _verdict(hv, lambda v: v >= TARGET_HIT) + ")")
        ttft = (f"TTFT p50 {_ms(s[f'ttft_p50_cache_aware_{k}'])} = "
                + (f"{tv:.2f}x" if tv is not None else "-")
                + f" round_robin's {_ms(s[f'ttft_p50_round_robin_{k}'])} (target <= "
                + f"{TARGET_TTFT}x: " + _verdict(tv, lambda v: v <= TARGET_TTFT) + ")")
        out.append(f"{w}: cache_aware {hit}; {ttft}")
    return out


def _verdict(v: float | None, ok: Callable[[float], bool]) -> str:
    return "no data" if v is None else ("met" if ok(v) else "MISSED")


def hit_rate_plot(s: dict[str, Any], workloads: list[str], path: str) -> str:
    """Bars: each profile's hit rate per workload, the workload's ceiling dashed."""
    from bench.plots import _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(PROFILES)
    for j, w in enumerate(workloads):
        k = w.replace("-", "_")
        for i, prof in enumerate(PROFILES):
            x = j + (i - (len(PROFILES) - 1) / 2) * width
            ax.bar(x, s[f"hit_rate_{prof}_{k}"], width, color=f"C{i}",
                   label=prof if j == 0 else None)
        ax.hlines(s[f"hit_ceiling_{k}"], j - 0.45, j + 0.45, colors="k", linestyles="--",
                  label="infinite-cache ceiling" if j == 0 else None)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("cached prompt tokens / prompt tokens")
    ax.set_title("Prefix hit rate per routing profile")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


def run_bench(bcfg: RoutingBenchConfig, cfg: ExperimentConfig) -> Report:
    work = build_workloads(bcfg, cfg)
    admin_key = secrets.token_hex(16)
    ncpu = os.cpu_count() or 1
    # One core per worker, round the cores: each worker gets one thread (3 workers on 2
    # cores: two share core 0; the same cluster serves every profile).
    pins = {f"colocated-{i}": str(i % ncpu) for i in range(bcfg.workers)}
    gateway_args = ("--routing", profile_path(PROFILES[0]), "--admin-key", admin_key)
    with start_cluster(cfg, colocated=bcfg.workers, pins=pins,
                       gateway_args=gateway_args) as cluster:
        phases = measure(cfg, cluster, run_phases(cfg, cluster.url, admin_key, work))[0]
    summary = summarize(phases, work, bcfg.block_size)
    notes = [*target_lines(summary, list(work)),
             f"One cluster of {bcfg.workers} colocated workers (pinned one per core, round "
             f"the {ncpu} cores); the profile is swapped through POST /admin/v1/routing "
             "before each phase; each phase sends its own cache_salt (cold caches).",
             "hit_rate: prompt tokens the workers reported cached / prompt tokens; "
             "hit_ceiling: the same for one unbounded cache that saw every request in "
             f"order ({bcfg.block_size}-token blocks), the ceiling for any routing."]
    if "mooncake" in work:
        notes.append(f"mooncake: {len(work['mooncake'][0])} records of {bcfg.trace_path} "
                     f"(every {bcfg.trace_sample}th conversation, all its turns), "
                     f"{bcfg.block_tokens} tokens per hash id, prompts capped at "
                     f"{bcfg.max_input_len} tokens, outputs at {bcfg.max_output_len}, "
                     f"timestamps x{bcfg.time_scale:g}.")
    if "shared-prefix" in work:
        notes.append(f"shared-prefix: {bcfg.groups} groups x {bcfg.per_group} requests "
                     f"({bcfg.prefix_len}-token prefix + {bcfg.suffix_len}), shuffled, "
                     f"Poisson {bcfg.rate:g} req/s, {bcfg.output_len} output tokens.")
    return Report("bench-routing", "Routing profiles: round-robin vs least-loaded vs "
                  "cache-aware on one cluster", phases, summary=summary, notes=notes,
                  config={"profiles": list(PROFILES), "workloads": list(work),
                          "bench": {f: getattr(bcfg, f) for f in bcfg.__dataclass_fields__}})


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = RoutingBenchConfig()
    p.add_argument("--model", default=None, help="model directory (default: embedded model)")
    p.add_argument("--json", default=None, help="also write the JSON report here")
    p.add_argument("--out-dir", default="bench-results")
    p.add_argument("--quick", action="store_true", help="a few-second version (tests)")
    p.add_argument("--workers", type=int, default=d.workers, help="colocated workers")
    p.add_argument("--workload", default=d.workload, choices=(*WORKLOADS, "both"))
    p.add_argument("--trace", default=d.trace_path, help="Mooncake JSONL trace")
    p.add_argument("--records", type=int, default=None,
                   help=f"trace records replayed, at most (default {d.records})")
    p.add_argument("--trace-sample", type=int, default=None, metavar="N",
                   help=f"keep every N-th conversation of the trace (default {d.trace_sample})")
    p.add_argument("--block-tokens", type=int, default=None,
                   help=f"prompt tokens per trace hash id (default {d.block_tokens})")
    p.add_argument("--time-scale", type=float, default=None,
                   help=f"trace seconds -> replay seconds (default {d.time_scale})")
    p.add_argument("--max-input-len", type=int, default=None)
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument("--groups", type=int, default=None, help="shared-prefix groups")
    p.add_argument("--per-group", type=int, default=None)
    p.add_argument("--prefix-len", type=int, default=None)
    p.add_argument("--suffix-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--rate", type=float, default=None, help="shared-prefix req/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--phase-timeout", type=float, default=600.0)
    p.add_argument("--no-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> RoutingBenchConfig:
    """Defaults (or `quick()`'s), then every flag given explicitly."""
    bcfg = RoutingBenchConfig(workers=args.workers, workload=args.workload,
                              trace_path=args.trace)
    if args.quick:
        bcfg = bcfg.quick()
    given = {f: getattr(args, f) for f in ("records", "trace_sample", "block_tokens",
                                           "time_scale", "max_input_len", "max_output_len",
                                           "groups", "per_group", "prefix_len", "suffix_len",
                                           "output_len", "rate")
             if getattr(args, f) is not None}
    return replace(bcfg, **given)


def run(args: argparse.Namespace) -> int:
    from bench.report import write_report
    from cluster.launcher import ClusterError
    from engine.cli import resolve_model

    t0 = time.monotonic()
    try:
        bcfg = config_from_args(args)
        cfg = ExperimentConfig(model_dir=resolve_model(args.model), out_dir=args.out_dir,
                               quick=args.quick, seed=args.seed,
                               progress=not args.no_progress,
                               phase_timeout_s=args.phase_timeout)
        report = run_bench(bcfg, cfg)
    except (BenchError, ClusterError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths = write_report(report, args.out_dir, args.json)
    from bench.plots import available

    if available():
        plot = hit_rate_plot(report.summary, report.config["workloads"],
                             os.path.join(args.out_dir, "bench-routing-hit-rate.png"))
        paths["plots"].append(plot)
        with open(paths["markdown"], "a") as f:
            f.write(f"\n![bench-routing-hit-rate]({os.path.basename(plot)})\n")
    with open(paths["markdown"]) as f:
        print(f.read())
    print("targets:")
    for line in target_lines(report.summary, report.config["workloads"]):
        print(f"  {line}")
    print(f"wrote {paths['markdown']}, {', '.join(paths['json'])}, {len(paths['plots'])} plots"
          f" (in {os.path.abspath(args.out_dir)}; {time.monotonic() - t0:.0f} s)")
    return 0 if not report.summary["failed_requests"] else 1
