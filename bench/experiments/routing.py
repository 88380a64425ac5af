"""`routing`: routing profiles on a shared-prefix workload and a Mooncake trace replay,
two colocated workers (pinned to core 0 and core 1) behind the gateway.

Profiles: `load` (queue depth + KV usage: no cache awareness) and `prefix`
(`prefix_locality` from the Redis block index, with queue depth to break ties and
spread load), plus any YAML profiles given with `--profiles`. Each profile gets a fresh
cluster (cold caches) and both workloads; the figures are the cached-token ratio the
servers report (`usage.prompt_tokens_details.cached_tokens`) and TTFT.
"""

from __future__ import annotations

import os
from typing import Any

from bench.base import BenchError, BenchRequest
from bench.clients import OpenAIClient
from bench.datasets import mooncake, shared_prefix
from bench.experiments.common import (
    ExperimentConfig,
    measure,
    phase_kw,
    pick,
    start_cluster,
    tokens,
)
from bench.load import LoadSpec
from bench.report import Report
from bench.runner import Phase, run_phase

MOONCAKE_TRACE = "/work/shared/data/mooncake/conversation_trace.jsonl"
BUILTIN = {
    "load": "  scorers:\n    - {name: queue, weight: 1.0}\n    - {name: kv_usage, weight: 0.5}\n",
    "prefix": "  scorers:\n    - {name: prefix_locality, weight: 1.0}\n"
              "    - {name: queue, weight: 0.5}\n",
}


def profiles(cfg: ExperimentConfig) -> dict[str, str]:
    """name -> routing YAML path (built-ins written under out_dir, then `--profiles`)."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    out = {}
    for name, scorers in BUILTIN.items():
        path = os.path.join(cfg.out_dir, f"routing-{name}.yaml")
        with open(path, "w") as f:
            f.write(f"routing:\n{scorers}  picker: max_score\n")
        out[name] = path
    for path in cfg.profiles:
        if not os.path.isfile(path):
            raise BenchError(f"routing profile {path!r} does not exist")
        out[os.path.splitext(os.path.basename(path))[0]] = path
    return out


def workloads(cfg: ExperimentConfig) -> dict[str, tuple[list[BenchRequest], LoadSpec]]:
    pool = tokens(cfg)
    if cfg.quick:
        sp = shared_prefix(pool, 2, 3, 192, 16, 4, cfg.seed)
        sp_load = LoadSpec("poisson", rate=8.0, seed=cfg.seed)
        trace_n, time_scale = 8, 0.02
    else:
        sp = shared_prefix(pool, 6, 6, 512, 32, 8, cfg.seed)
        sp_load = LoadSpec("poisson", rate=3.0, seed=cfg.seed)
        trace_n, time_scale = 120, 0.25
    out = {"shared-prefix": (sp, sp_load)}
    trace = cfg.trace_path or MOONCAKE_TRACE
    if os.path.isfile(trace):
        reqs = mooncake(trace, pool, limit=trace_n, block_tokens=16, time_scale=time_scale,
                        max_output_len=8, max_input_len=1800)
        out["mooncake"] = (reqs, LoadSpec("trace"))
    return out


def ideal_cached_ratio(reqs: list[BenchRequest], block_size: int = 16) -> float:
    """Cached prompt tokens / prompt tokens if one cache of unbounded size saw every
    request in order: each request's leading full blocks already sent before. The
    ceiling any routing can reach (token-id prompts only)."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in reqs:
        ids = tuple(r.prompt) if not isinstance(r.prompt, str) else ()
        total += r.prompt_len
        prefixes = [ids[:(k + 1) * block_size] for k in range(len(ids) // block_size)]
        k = 0
        while k < len(prefixes) and prefixes[k] in seen:
            k += 1
        # The engine recomputes at least the last prompt token, as vLLM does.
        hit += min(k * block_size, max(0, r.prompt_len - 1))
        seen.update(prefixes)
    return hit / total if total else 0.0


def run(cfg: ExperimentConfig) -> Report:
    work = workloads(cfg)
    phases: list[Phase] = []
    summary: dict[str, Any] = {}
    for prof, path in profiles(cfg).items():
        async def body(client: OpenAIClient, p: str = prof) -> list[Phase]:
            return [await run_phase(client, reqs, load, name=f"{p} / {w}", config=p,
                                    **phase_kw(cfg)) for w, (reqs, load) in work.items()]

        with start_cluster(cfg, colocated=2, pins={"colocated-0": "0", "colocated-1": "1"},
                           gateway_args=("--routing", path)) as cluster:
            for phase in measure(cfg, cluster, body)[0]:
                phases.append(phase)
                w = phase.name.split(" / ")[1]
                summary[f"cached_ratio_{prof}_{w}"] = round(phase.summary["cached_ratio"], 4)
                summary[f"ttft_p50_{prof}_{w}"] = pick(phase.summary, "ttft_s", "p50")
    for w, (reqs, _) in work.items():
        summary[f"cached_ratio_ideal_{w}"] = round(ideal_cached_ratio(reqs), 4)
    summary["failed_requests"] = sum(p.summary["failed"] for p in phases)
    notes = ["Each profile starts a fresh cluster (cold caches); the same requests and "
             "arrival times for every profile.",
             "cached_ratio: prompt tokens the servers reported as cached / prompt tokens; "
             "cached_ratio_ideal: the same for one unbounded cache that saw every request "
             "(16-token blocks), the ceiling for any routing."]
    if "mooncake" in work:
        notes.append(f"mooncake: the first {len(work['mooncake'][0])} records of "
                     f"{cfg.trace_path or MOONCAKE_TRACE}, 16 tokens per hash id, outputs "
                     "capped at 8 tokens, timestamps scaled.")
    return Report("routing", "Routing profiles: shared prefixes and a Mooncake trace", phases,
                  summary=summary, notes=notes,
                  config={"profiles": list(profiles(cfg)), "workloads": list(work)})
