"""`transports`: the same disaggregated cluster (prefill on core 0, decode on core 1)
with each KV transport (ucx, tcp, shm), one after the other, same prompts.

Every prompt is prefilled remotely (decider threshold below the prompt length), one at
a time, so TTFT is prefill + hand-off + the first token's way back. The hand-off is
read from the decode worker's `splitserve:kv_transfer_seconds` histogram (first write
seen -> all blocks in place), averaged over the phase; bytes from
`splitserve:kv_transfer_bytes`. A transport that cannot start here is reported, not
fatal.
"""

from __future__ import annotations

import os
from typing import Any

from bench.base import BenchError
from bench.clients import OpenAIClient
from bench.experiments.common import (
    ExperimentConfig,
    fixed,
    measure,
    phase_kw,
    pick,
    start_cluster,
    tokens,
)
from bench.load import LoadSpec
from bench.report import Report
from bench.runner import Phase, run_phase
from cluster.launcher import ClusterError


def routing_yaml(cfg: ExperimentConfig, threshold: int) -> str:
    os.makedirs(cfg.out_dir, exist_ok=True)
    path = os.path.join(cfg.out_dir, f"routing-threshold-{threshold}.yaml")
    with open(path, "w") as f:
        f.write("routing:\n  scorers:\n    - {name: queue, weight: 1.0}\n"
                "    - {name: kv_usage, weight: 0.5}\n  picker: power_of_two\n"
                f"  decider: {{name: threshold, threshold: {threshold}}}\n")
    return path


def run(cfg: ExperimentConfig) -> Report:
    n, prompt_len, out_len = (3, 256, 2) if cfg.quick else (24, 1024, 4)
    pool = tokens(cfg)
    # Distinct prompts per transport would change the work; the same ones with a fresh
    # cluster each time means no prefix-cache hits carry over.
    reqs = fixed(pool, n, prompt_len, out_len, cfg.seed, "long")
    phases: list[Phase] = []
    summary: dict[str, Any] = {}
    notes = [f"{n} prompts of {prompt_len} tokens ({out_len} output tokens), one at a time; "
             "every prompt is prefilled remotely (decider threshold 16)."]
    routing = ("--routing", routing_yaml(cfg, 16))
    for transport in cfg.transports:
        async def body(client: OpenAIClient, t: str = transport) -> list[Phase]:
            return [await run_phase(client, reqs, LoadSpec("concurrency", concurrency=1),
                                    name=t, config=t, **phase_kw(cfg))]

        try:
            with start_cluster(cfg, prefill=1, decode=1, transport=transport,
                               pins={"prefill-0": "0", "decode-0": "1"},
                               gateway_args=routing) as cluster:
                (phase,), grew = measure(cfg, cluster, body, warm_prompt_len=64,
                                         metrics_ports=cluster.worker_metrics_ports("decode"))
        except (ClusterError, BenchError) as e:
            notes.append(f"{transport}: could not run ({str(e).splitlines()[0][:200]})")
            summary[f"ttft_p50_{transport}"] = None
            continue
        phases.append(phase)
        count = grew.get("splitserve:kv_transfer_seconds_count", 0.0)
        secs = grew.get("splitserve:kv_transfer_seconds_sum", 0.0)
        summary[f"ttft_p50_{transport}"] = pick(phase.summary, "ttft_s", "p50")
        summary[f"ttft_p99_{transport}"] = pick(phase.summary, "ttft_s", "p99")
        summary[f"kv_handoff_mean_s_{transport}"] = round(secs / count, 6) if count else None
        summary[f"kv_transfers_{transport}"] = int(count)
        summary[f"kv_bytes_{transport}"] = int(grew.get("splitserve:kv_transfer_bytes_total", 0.0))
    summary["failed_requests"] = sum(p.summary["failed"] for p in phases)
    if not phases:
        raise BenchError("no transport could run: " + "; ".join(notes[1:]))
    notes.append("kv_handoff_mean_s: the decode worker's splitserve:kv_transfer_seconds "
                 "(first write -> all blocks in place) averaged over the phase.")
    return Report("transports", "KV transports for one disaggregated cluster (2 cores)",
                  phases, summary=summary, config={"transports": list(cfg.transports),
                                                   "prompts": n, "prompt_len": prompt_len},
                  notes=notes)
