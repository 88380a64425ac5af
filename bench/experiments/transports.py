"""`transports`: the same disaggregated cluster with each KV transport, one after the
other, same prompts, against a colocated worker (the baseline: no hand-off at all).
On the CPU (default): ucx, tcp, shm, prefill on core 0, decode on core 1, 1024-token
prompts. With `--device cuda`: cuda_ipc and ucx, both workers on one GPU, 8k-token
prompts on the llama3-8b shape (random weights) unless `--model` / `--model-shape`.

Every 1P1D prompt is prefilled remotely (decider threshold below the prompt length), one
at a time, so TTFT is prefill + hand-off + the first token's way back. The hand-off is
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


def _workload(cfg: ExperimentConfig) -> tuple[int, int, int]:
    """(prompts, prompt tokens, output tokens). On a GPU an 8k context: the prompt and
    its output tokens within the model's positions (the gateway refuses a request past
    them, 400: the llama3-8b shape's 8192 take 8188 prompt tokens and 4 out)."""
    if cfg.device.startswith("cuda"):
        if cfg.quick:
            return (2, 1024, 2)
        from engine.config import ModelConfig

        ctx = ModelConfig.from_model_dir(cfg.model_dir).max_position_embeddings
        return (8, min(8192, ctx) - 4, 4)
    return (3, 256, 2) if cfg.quick else (24, 1024, 4)


def configurations(cfg: ExperimentConfig, prompt_len: int) -> list[tuple[str, dict[str, Any]]]:
    """(name, start_cluster keywords): the colocated baseline, then 1P1D per transport.

    CPU: each worker pinned to its own core (the colocated one to the prefill's core),
    so every configuration computes a prompt on one core. GPU: every worker on the one
    device, bf16, each with its own KV pool of 8 GiB (two processes share the GPU, so
    neither sizes its pool from free memory)."""
    gpu = cfg.device.startswith("cuda")
    worker_args: tuple[str, ...] = ()
    if gpu:
        worker_args = ("--device", cfg.device, "--dtype", "bfloat16", "--load-format",
                       cfg.load_format, "--kv-cache-memory", "8GiB",
                       "--max-model-len", str(prompt_len + 256))
    routing = ("--routing", routing_yaml(cfg, 16))
    out: list[tuple[str, dict[str, Any]]] = [("colocated", {
        "colocated": 1, "pins": None if gpu else {"colocated-0": "0"},
        "worker_args": worker_args})]
    for t in cfg.transports:
        out.append((t, {"prefill": 1, "decode": 1, "transport": t,
                        "pins": None if gpu else {"prefill-0": "0", "decode-0": "1"},
                        "gateway_args": routing, "worker_args": worker_args}))
    return out


def run(cfg: ExperimentConfig) -> Report:
    n, prompt_len, out_len = _workload(cfg)
    gpu = cfg.device.startswith("cuda")
    pool = tokens(cfg)
    # Distinct prompts per configuration would change the work; the same ones with a
    # fresh cluster each time means no prefix-cache hits carry over.
    reqs = fixed(pool, n, prompt_len, out_len, cfg.seed, "long")
    phases: list[Phase] = []
    summary: dict[str, Any] = {}
    notes = [f"{n} prompts of {prompt_len} tokens ({out_len} output tokens), one at a time; "
             "in 1P1D every prompt is prefilled remotely (decider threshold 16)."]
    for name, kw in configurations(cfg, prompt_len):
        async def body(client: OpenAIClient, c: str = name) -> list[Phase]:
            return [await run_phase(client, reqs, LoadSpec("concurrency", concurrency=1),
                                    name=c, config=c, **phase_kw(cfg))]

        try:
            with start_cluster(cfg, **kw) as cluster:
                (phase,), grew = measure(cfg, cluster, body, warm_prompt_len=64,
                                         metrics_ports=cluster.worker_metrics_ports("decode"))
        except (ClusterError, BenchError) as e:
            notes.append(f"{name}: could not run ({str(e).splitlines()[0][:200]})")
            summary[f"ttft_p50_{name}"] = None
            continue
        phases.append(phase)
        summary[f"ttft_p50_{name}"] = pick(phase.summary, "ttft_s", "p50")
        summary[f"ttft_p99_{name}"] = pick(phase.summary, "ttft_s", "p99")
        if name == "colocated":
            continue
        count = grew.get("splitserve:kv_transfer_seconds_count", 0.0)
        secs = grew.get("splitserve:kv_transfer_seconds_sum", 0.0)
        summary[f"kv_handoff_mean_s_{name}"] = round(secs / count, 6) if count else None
        summary[f"kv_transfers_{name}"] = int(count)
        summary[f"kv_bytes_{name}"] = int(grew.get("splitserve:kv_transfer_bytes_total", 0.0))
        base, mine = summary.get("ttft_p50_colocated"), summary[f"ttft_p50_{name}"]
        summary[f"ttft_vs_colocated_{name}"] = round(mine / base, 3) if base and mine else None
    summary["failed_requests"] = sum(p.summary["failed"] for p in phases)
    if not phases:
        raise BenchError("no configuration could run: " + "; ".join(notes[1:]))
    notes.append("kv_handoff_mean_s: the decode worker's splitserve:kv_transfer_seconds "
                 "(first write -> all blocks in place) averaged over the phase; "
                 "ttft_vs_colocated: 1P1D TTFT p50 over the colocated worker's.")
    where = f"one GPU ({cfg.device})" if gpu else "2 cores"
    return Report("transports", f"KV transports for one disaggregated cluster vs colocated "
                  f"({where})", phases, summary=summary,
                  config={"transports": list(cfg.transports), "prompts": n,
                          "prompt_len": prompt_len, "device": cfg.device,
                          "model": os.path.basename(cfg.model_dir.rstrip("/"))},
                  notes=notes)
