"""Tensor-parallel KV caches on CPU are per-rank named shared-memory segments that rank
0 maps (`ModelRunner.rank_caches`): rank 0 sees what rank 1's forward wrote into rank
1's own cache, and every segment name is gone once the engine closed."""

from __future__ import annotations

import os

import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.factories import tiny_model_dir


def _ours(pid: int) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"splitserve-kv-{pid}-tp"))


def test_tp_rank_caches_are_per_rank_segments_that_get_cleaned() -> None:
    llm = LLM(tiny_model_dir("llama"), dtype="float32", block_size=4, num_blocks=32,
              tensor_parallel_size=2)
    try:
        runner = llm.engine.runner
        assert runner.tp is not None
        assert _ours(os.getpid()) == sorted(runner.tp.segments) and len(runner.tp.segments) == 2
        caches = runner.rank_caches
        assert caches is not None and len(caches) == 2
        assert caches[0].data_ptr() == runner.kv_cache.data_ptr()  # rank 0's own first
        assert caches[1].shape == caches[0].shape and caches[1].data_ptr() != \
            caches[0].data_ptr()
        llm.generate([[5, 6, 7, 8, 9, 10, 11]], SamplingParams(max_tokens=2, temperature=0))
        # rank 1 wrote its heads of the prompt's KV into its own segment; the same
        # blocks on rank 0 hold other heads (two KV heads, one per rank)
        written = [b for b in range(runner.num_blocks) if caches[1][b].abs().sum() > 0]
        assert written and all(caches[0][b].abs().sum() > 0 for b in written)
        assert not torch.equal(caches[0][written[0]], caches[1][written[0]])
        assert runner.staged_blocks == 0
    finally:
        llm.engine.close()
    assert _ours(os.getpid()) == []
