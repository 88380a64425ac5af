"""CUDA graphs for mixed and prefill steps on the GPU (skipped without one): captured per
token bucket at start-up, replayed, and token-identical to --enforce-eager and to
transformers (float32) through chunked prefill, prefix hits and preemption; steps over
--max-graph-tokens run eagerly; the torch attention backend captures nothing. DeepSeek
(MLA) captures its mixed steps too: the absorbed kernel attends in the latent space."""

from __future__ import annotations

from typing import Any

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.factories import hf_greedy, hf_model, tiny_model_dir

pytestmark = pytest.mark.gpu


def _prompts() -> list[list[int]]:
    # Ragged, longer than one chunk, sharing a prefix (prefix-cache hits).
    base = [(13 * j) % 400 + 5 for j in range(40)]
    return [base + [(5 * i + j) % 300 + 7 for j in range(n)]
            for i, n in enumerate((3, 17, 60, 9, 33, 1, 80, 25))]


def _generate(arch: str, **kw: Any) -> tuple[list[list[int]], LLM]:
    # Few blocks: the batch does not fit, so requests are preempted and recomputed.
    llm = LLM(tiny_model_dir(arch), dtype="float32", device="cuda", num_blocks=40,
              block_size=16, max_num_seqs=8, max_num_batched_tokens=64, **kw)
    params = [SamplingParams(max_tokens=8 + i, temperature=0) for i in range(8)]
    outs = llm.generate(_prompts(), params)
    llm.engine.check_integrity()
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks and stats.prefix_cache_hits > 0
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v2"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_graphs_equal_eager_and_transformers(arch: str, async_scheduling: bool) -> None:
    got, llm = _generate(arch, async_scheduling=async_scheduling)
    graphs = llm.engine.runner.mixed_graphs
    assert graphs is not None and sorted(graphs._graphs) == graphs.buckets
    assert graphs.max_tokens == 64 and graphs.replays > 0
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0
    eager, ref = _generate(arch, async_scheduling=async_scheduling, enforce_eager=True)
    assert ref.engine.runner.mixed_graphs is None and ref.engine.runner.graphs is None
    hf = hf_model(tiny_model_dir(arch))
    eos = llm.engine.eos_token_ids[0] if llm.engine.eos_token_ids else None
    for i, (prompt, a, b) in enumerate(zip(_prompts(), got, eager, strict=True)):
        assert a == b == hf_greedy(hf, prompt, 8 + i, eos), (arch, len(prompt))


def test_steps_over_max_graph_tokens_run_eagerly() -> None:
    got, llm = _generate("llama", max_graph_tokens=16)
    graphs = llm.engine.runner.mixed_graphs
    assert graphs is not None and graphs.buckets[-1] == 16 and graphs.replays > 0
    off, ref = _generate("llama", max_graph_tokens=0)
    assert ref.engine.runner.mixed_graphs is None and ref.engine.runner.graphs is not None
    assert got == off


def test_torch_backend_captures_nothing() -> None:
    got, llm = _generate("llama", attention_backend="torch")
    assert llm.engine.runner.graphs is None and llm.engine.runner.mixed_graphs is None
    eager, _ = _generate("llama", enforce_eager=True)
    assert got == eager


def test_mla_steps_over_max_graph_tokens_decompress_eagerly() -> None:
    """DeepSeek: buckets of up to 16 tokens attend in the latent space (graphs), the
    larger steps decompress K/V eagerly; the tokens equal those of all-eager steps."""
    got, llm = _generate("deepseek_v2", max_graph_tokens=16)
    graphs = llm.engine.runner.mixed_graphs
    assert graphs is not None and graphs.fixed_meta and graphs.buckets[-1] == 16
    assert graphs.replays > 0
    eager, _ = _generate("deepseek_v2", enforce_eager=True)
    assert got == eager
