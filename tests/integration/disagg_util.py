"""The harness of the disaggregated-serving tests (test_disagg.py, test_tp_disagg.py, the
GPU hand-off tests): a cluster of one prefill and one decode worker (cluster.launcher,
as `splitserve up` starts them) whose routing profile sends every prompt to the prefill
worker (decider threshold 0), and the checks every hand-off test makes."""

from __future__ import annotations

import asyncio
import functools
import os
from typing import Any

from cluster.launcher import ClusterSpec, LocalCluster
from engine.config import ModelConfig
from tests.factories import hf_greedy, hf_model, tiny_model_dir
from tests.integration.serving_util import grpc_generate, load_report, metric, wait_for

NUM_BLOCKS = 128
WORKER_ARGS = ("--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "32",
               "--max-num-batched-tokens", "64", "--log-level", "INFO")
ALWAYS_REMOTE = ("routing:\n  scorers: [{name: queue, weight: 1.0}]\n  picker: max_score\n"
                 "  decider: {name: threshold, threshold: 0}\n")


def start_cluster(tmp_path: Any, transport: str, extra_worker_args: tuple[str, ...] = (),
                  arch: str = "llama", *, model_dir: str | None = None,
                  placement: dict[str, Any] | None = None,
                  ready_timeout_s: float = 150) -> LocalCluster:
    """A started 1P1D cluster of `arch`'s tiny model (or `model_dir`); logs and the
    routing profile under `tmp_path`. The caller stops it."""
    profile = tmp_path / "routing.yaml"
    profile.write_text(ALWAYS_REMOTE)
    spec = ClusterSpec(model_dir=model_dir or tiny_model_dir(arch), num_prefill=1,
                       num_decode=1, num_colocated=0, transport=transport,
                       worker_args=WORKER_ARGS + extra_worker_args,
                       gateway_args=("--routing", str(profile)),
                       ready_timeout_s=ready_timeout_s, log_dir=str(tmp_path / "logs"),
                       placement=placement or {})
    c = LocalCluster(spec)
    c.start()
    return c


def child(cluster: LocalCluster, name: str) -> Any:
    return next(c for c in cluster.children if c.name == name)


def logs(cluster: LocalCluster) -> str:
    return "\n".join(f"== {c.name}\n{c.log_tail(20)}" for c in cluster.children
                     if c.name != "redis")


def decode_metrics(cluster: LocalCluster) -> int:
    """The decode worker's metrics port."""
    return int(child(cluster, "decode-0").extra["metrics_port"])


def all_blocks_free(cluster: LocalCluster) -> bool:
    reps = [load_report(child(cluster, n).grpc_address) for n in ("prefill-0", "decode-0")]
    return all(r.num_free_blocks == r.num_blocks == NUM_BLOCKS and r.num_active == 0
               for r in reps)


def generate_remotely(cluster: LocalCluster, prompts: list[list[int]],
                      max_tokens: list[int]) -> tuple[list[list[int]], float]:
    """Greedy token ids of `prompts` through the gateway (gRPC, concurrently), checking
    that each was prefilled on the prefill worker and that both workers free every block
    afterwards; returns them and the KV bytes the decode received meanwhile (over the
    cluster's transport). Counters are read before and after, so a cluster shared by
    several tests gives each its own figures."""
    port, transport = decode_metrics(cluster), cluster.spec.transport

    def counters() -> tuple[float, float]:
        return (metric(port, "splitserve:remote_prefill_total", outcome="ok"),
                metric(port, "splitserve:kv_transfer_bytes_total", transport=transport))

    ok0, moved0 = counters()
    got = asyncio.run(grpc_generate(f"127.0.0.1:{cluster.grpc_port}", prompts, max_tokens))
    ok, moved = counters()
    assert ok - ok0 == len(prompts), logs(cluster)  # every KV crossed the transport
    wait_for(lambda: all_blocks_free(cluster), 10, "every block free on both workers")
    return got, moved - moved0


def mixed_prompts() -> tuple[list[list[int]], list[int]]:
    lengths = [3, 17, 40, 90, 5, 33, 64, 128, 8, 21, 50, 75, 12, 100, 16, 200]
    prompts = [[(11 * i + 17 * j) % 500 + 1 for j in range(n)] for i, n in enumerate(lengths)]
    # Two prompts share a 48-token prefix: the second hits the decode's prefix cache.
    prompts[9] = prompts[7][:48] + prompts[9]
    return prompts, [4 + (i * 7) % 29 for i in range(len(prompts))]


def shm_left_behind(cluster: LocalCluster) -> list[str]:
    """The shared-memory segments the cluster's workers made (kvtransfer/shm.py names
    them after the creating process) that are still there; others' are not looked at,
    as other test runs on the machine may be making theirs."""
    pids = {str(c.proc.pid) for c in cluster.children}
    return [n for n in os.listdir("/dev/shm")
            if n.startswith("splitserve-kv-") and n.split("-")[2] in pids]


def transformers_greedy(model_dir: str, prompts: list[list[int]],
                        max_tokens: list[int]) -> list[list[int]]:
    """transformers' greedy ids of each prompt, computed once per model and prompts (the
    hand-off tests check the same prompts over several transports and TP sizes)."""
    return _greedy(model_dir, tuple(map(tuple, prompts)), tuple(max_tokens))


@functools.cache
def _greedy(model_dir: str, prompts: tuple[tuple[int, ...], ...],
            max_tokens: tuple[int, ...]) -> list[list[int]]:
    hf = hf_model(model_dir)
    eos = ModelConfig.from_model_dir(model_dir).eos_token_ids
    return [hf_greedy(hf, list(p), m, eos[0] if eos else None)
            for p, m in zip(prompts, max_tokens, strict=True)]
