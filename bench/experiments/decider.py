"""`decider`: a sweep of the local-vs-remote prefill threshold on one disaggregated
cluster shape (prefill on core 0, decode on core 1, tcp).

The decider sends a prompt to the prefill worker when its uncached part is longer than
the threshold. Threshold 0 sends every prompt away (full disaggregation); a threshold
above every prompt keeps all prefills on the decode worker (no disaggregation). The
workload mixes prompt lengths (uniform) under Poisson arrivals, so each threshold
splits it differently. The cluster restarts per threshold (the gateway reads its
routing profile at start), with the same prompts and arrival times.
"""

from __future__ import annotations

from typing import Any

from bench.clients import OpenAIClient
from bench.datasets import LengthDist, synthetic
from bench.experiments.common import (
    ExperimentConfig,
    measure,
    phase_kw,
    pick,
    start_cluster,
    tokens,
)
from bench.experiments.transports import routing_yaml
from bench.load import LoadSpec
from bench.report import Report
from bench.runner import Phase, run_phase


def run(cfg: ExperimentConfig) -> Report:
    thresholds: tuple[int, ...]
    if cfg.quick:
        n, mean, spread, out_len, rate, thresholds = 6, 160, 120, 4, 6.0, (0, 4096)
    else:
        n, mean, spread, out_len, rate, thresholds = 40, 640, 600, 16, 2.0, (0, 128, 512, 4096)
    pool = tokens(cfg)
    reqs = synthetic(pool, n, LengthDist("uniform", mean, spread), LengthDist(mean=out_len),
                     seed=cfg.seed, tag="mixed")
    load = LoadSpec("poisson", rate=rate, seed=cfg.seed)
    phases: list[Phase] = []
    summary: dict[str, Any] = {}
    for th in thresholds:
        async def body(client: OpenAIClient, t: int = th) -> list[Phase]:
            return [await run_phase(client, reqs, load, name=f"threshold {t}",
                                    config="disagg", params={"threshold": t},
                                    **phase_kw(cfg))]

        with start_cluster(cfg, prefill=1, decode=1, pins={"prefill-0": "0", "decode-0": "1"},
                           gateway_args=("--routing", routing_yaml(cfg, th))) as cluster:
            ports = cluster.worker_metrics_ports("decode")
            (phase,), grew = measure(cfg, cluster, body, metrics_ports=ports)
            remote = grew.get("splitserve:remote_prefill_total", 0.0)
        phases.append(phase)
        summary[f"ttft_p50_t{th}"] = pick(phase.summary, "ttft_s", "p50")
        summary[f"tpot_p99_t{th}"] = pick(phase.summary, "tpot_s", "p99")
        summary[f"e2e_p50_t{th}"] = pick(phase.summary, "e2e_s", "p50")
        summary[f"remote_prefills_t{th}"] = int(remote)
    summary["failed_requests"] = sum(p.summary["failed"] for p in phases)
    notes = [f"{n} prompts of {mean - spread}-{mean + spread} tokens (uniform), {out_len} "
             f"output tokens, Poisson arrivals at {rate:g} req/s; thresholds {list(thresholds)}."]
    return Report("decider", "Local-vs-remote prefill threshold sweep (1 prefill + 1 decode)",
                  phases, summary=summary, notes=notes,
                  config={"thresholds": list(thresholds), "rate": rate})
