"""`splitserve:kv_staging_blocks_total` is the model runner's one count of blocks copied
through rank 0's full-head staging copy: the hand-off's gathers and scatters (worker/
server.py's stage and land) and the offload tiers' (engine/offload.py), each once."""

from __future__ import annotations

import asyncio

import torch
from prometheus_client import generate_latest

from engine.async_llm import AsyncLLM
from engine.llm import make_engine_config
from tests.factories import tiny_model_dir
from worker.config import WorkerConfig
from worker.metrics import WorkerMetrics
from worker.server import KVSide, kv_layout_string
from worker.service import WorkerService


def staged(metrics: WorkerMetrics) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("splitserve:kv_staging_blocks_total "):
            return float(line.split()[1])
    raise AssertionError("no splitserve:kv_staging_blocks_total")


def test_staged_blocks_are_counted_once_by_the_runner() -> None:
    cfg = make_engine_config(tiny_model_dir("llama"), dtype="float32", block_size=4,
                             num_blocks=32, tensor_parallel_size=2)
    llm = AsyncLLM(cfg)
    try:
        metrics = WorkerMetrics("m", lambda: None)
        config = WorkerConfig(role="colocated", worker_id="w")
        side = KVSide(config, None, WorkerService(config, metrics, kv_layout_string(cfg)), metrics)
        assert staged(metrics) == 0  # before the engine exists
        runner = llm.engine.runner
        caches = list(runner.rank_caches or [])
        assert len(caches) == 2
        for c in caches:
            c.copy_(torch.randn(c.shape))
        runner.rank_caches = None  # rank 0 cannot address the ranks' caches (as on CUDA)
        staging = side._transport_kv(llm)
        assert staging is runner.staging()
        assert side._stage is not None
        asyncio.run(side._stage([1, 2, 3]))  # the hand-off's gather before a send
        runner.gather_blocks([4, 5], staging)  # a tier save's (engine/offload.py)
        # full-head blocks: each rank's KV heads side by side
        assert torch.equal(staging[[4, 5]], torch.cat([c[[4, 5]] for c in caches], dim=4))
        staging[6] = staging[5]
        runner.scatter_blocks([6], staging)  # a tier load's
        # (rank 1 runs commands in order: its write is done before it serves this read)
        staging[6] = 0
        runner.gather_blocks([6], staging)
        assert torch.equal(staging[6], staging[5])
        assert all(torch.equal(c[6], c[5]) for c in caches)
        assert runner.staged_blocks == 7
        assert staged(metrics) == 7
    finally:
        llm.shutdown()
