"""Graphs for mixed and prefill steps (engine/mixed_graphs.py), run here through
`padded_mixed`: each such step padded to its token bucket in the graphs' fixed-address
buffer, everything but the capture. Greedy output token-identical to the eager engine and
to transformers (float32) through chunked prefill, prefix hits and preemption, with the
torch backend (llama, Qwen3-MoE), the Triton kernels (Triton's interpreter: llama, and
DeepSeek-V2's MLA through the absorbed kernel), async
scheduling and tensor parallelism; and graphs only where the attention backend is
graph-safe."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import pytest
import torch

from engine.cli import add_engine_arguments, engine_config_from_args
from engine.config import EngineConfig
from engine.input_batch import InputBatch, StepPlan
from engine.kv_cache_manager import KVCacheManager
from engine.llm import LLM
from engine.mixed_graphs import token_buckets
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest
from engine.step_inputs import StepInputBuilder, layout_size, views
from tests.factories import hf_greedy, hf_model, tiny_model_dir
from tests.unit.engine.step_reference import layout_of, reference_layout
from tests.unit.engine.test_correctness import make_prompts

# chunks (prompts up to ~70 tokens), prefix hits, and too few blocks: preemption
ENGINE = dict(dtype="float32", block_size=4, num_blocks=40, max_num_seqs=8,
              max_num_batched_tokens=32)


def test_token_buckets() -> None:
    assert token_buckets(0) == []
    assert token_buckets(1) == [1]
    assert token_buckets(20) == [1, 2, 4, 8, 16, 20]
    sizes = token_buckets(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-3:] == [480, 496, 512]
    assert 248 in sizes and 256 in sizes and 264 not in sizes and len(sizes) == 51


def test_layout_of_a_mixed_step_padded_to_its_bucket() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    a = Request("a", list(range(10, 20)), SamplingParams())  # decodes its 10th token
    b = Request("b", list(range(30, 36)), SamplingParams())  # prefill chunk of 3 of 6
    for r in (a, b):
        assert kv.allocate_slots(r, r.num_tokens)
    a.num_computed_tokens = 9
    builder = StepInputBuilder(4, torch.device("cpu"), sliding_window=None)
    batch = InputBatch(capacity=2, width=2)
    sched = [ScheduledRequest(a, 1), ScheduledRequest(b, 3)]
    plan = batch.plan(sched, kv)
    # bucket 8 of an engine with max_num_seqs 4: 8 tokens, 5 sequences, 4 sampled rows,
    # built into the graphs' own buffer (fixed addresses)
    buf = torch.full((layout_size(8, 5, 8, 4),), -7, dtype=torch.int32)
    step = builder.build_planned(plan, batch, pad=(8, 5, 4), width=8, out=buf)
    ta, tb = kv.block_ids("a"), kv.block_ids("b")
    assert step.input_ids.tolist() == [19, 30, 31, 32, 0, 0, 0, 0]
    assert step.positions.tolist() == [9, 0, 1, 2, 0, 0, 0, 0]
    assert step.meta.slot_mapping.tolist() == [ta[2] * 4 + 1, tb[0] * 4, tb[0] * 4 + 1,
                                               tb[0] * 4 + 2, -1, -1, -1, -1]
    # padding sequences: one token each, the last one the rest; the batch ends at 8
    assert step.meta.query_start_loc.tolist() == [0, 1, 4, 5, 6, 8]
    assert step.meta.seq_lens.tolist() == [10, 3, 0, 0, 0]
    assert step.meta.block_tables.tolist() == [ta[:3] + [0] * 5, [tb[0]] + [0] * 7,
                                               *[[0] * 8] * 3]
    assert step.sample_rows.tolist() == [0, 0, 0, 0]  # a's row 0, then padding rows
    assert [r.request_id for r in step.sample_reqs] == ["a"]
    assert layout_of(step) == reference_layout(sched, kv, 4, pad=(8, 5, 4), width=8)
    views_of_buf = views(buf, 8, 5, 8, 4)
    for got, at in [(step.input_ids, views_of_buf[0]), (step.positions, views_of_buf[1]),
                    (step.meta.slot_mapping, views_of_buf[2]),
                    (step.meta.query_start_loc, views_of_buf[3]),
                    (step.meta.seq_lens, views_of_buf[4]),
                    (step.meta.block_tables, views_of_buf[5]),
                    (step.sample_rows, views_of_buf[6])]:
        assert got.data_ptr() == at.data_ptr() and torch.equal(got, at)
    # padding tokens need a padding sequence to own them
    with pytest.raises(ValueError, match="does not pad"):
        builder.build_planned(plan, batch, pad=(8, 2, 2), out=buf)


def _generate(arch: str, prompts: list[list[int]], params: list[SamplingParams],
              padded: bool, **kw: Any) -> tuple[list[list[int]], list[tuple[int, int]], LLM]:
    """(token ids per prompt, (bucket, real tokens) of each mixed step run padded, llm);
    the engine's stats at the end in `llm.final_stats`."""
    llm = LLM(tiny_model_dir(arch), padded_mixed=padded, **{**ENGINE, **kw})
    runner = llm.engine.runner
    steps: list[tuple[int, int]] = []
    try:
        assert (runner.mixed_graphs is not None) == padded
        if runner.mixed_graphs is not None:
            assert not runner.mixed_graphs._graphs  # nothing captured off CUDA
            run = runner.mixed_graphs.run

            def recording(t: int, step: Any) -> torch.Tensor:
                steps.append((t, int((step.meta.slot_mapping >= 0).sum())))
                return run(t, step)

            runner.mixed_graphs.run = recording  # type: ignore[method-assign]
        outs = llm.generate(prompts, params)
        llm.engine.check_integrity()
        stats = llm.final_stats = llm.engine.stats()  # type: ignore[attr-defined]
        assert stats.num_free_blocks == stats.num_blocks
    finally:
        llm.engine.close()
    return [o.token_ids for o in outs], steps, llm


def _check(arch: str, n: int, backend: str = "torch", **kw: Any) -> LLM:
    """Padded equals eager equals transformers; returns the padded run's engine."""
    prompts = make_prompts(n)
    params = [SamplingParams(max_tokens=3 + i, temperature=0) for i in range(n)]
    got, steps, llm = _generate(arch, prompts, params, True, attention_backend=backend, **kw)
    ref, none, _ = _generate(arch, prompts, params, False, attention_backend=backend)
    assert not none
    # padded steps, of several buckets, some with real tokens short of their bucket
    assert len({t for t, _ in steps}) > 1 and any(t > real for t, real in steps)
    assert all(real <= t for t, real in steps)
    hf = hf_model(tiny_model_dir(arch))
    eos = llm.engine.eos_token_ids[0] if llm.engine.eos_token_ids else None
    for prompt, p, a, b in zip(prompts, params, got, ref, strict=True):
        assert a == b == hf_greedy(hf, prompt, p.max_tokens, eos), (arch, prompt)
    return llm


# DeepSeek-V2 on Triton's interpreter (every kernel one Python loop per program) runs 4
# prompts in 24 blocks: still chunks, prefix hits, preemption and several buckets
@pytest.mark.parametrize("arch,backend,n,num_blocks", [
    ("llama", "torch", 10, 40), ("qwen3_moe", "torch", 10, 40),
    ("deepseek_v2", "triton", 4, 24)])
def test_padded_mixed_equals_eager_and_transformers_through_chunks_hits_and_preemption(
        arch: str, backend: str, n: int, num_blocks: int) -> None:
    """DeepSeek-V2 (MLA) on the Triton kernels (Triton's interpreter): its buckets run
    the absorbed kernel on each bucket's constant metadata, its eager run decompresses
    K/V for every step with a prefill."""
    if backend == "triton":
        pytest.importorskip("triton")
    assert max(len(p) for p in make_prompts(n)) > 32  # chunks
    llm = _check(arch, n, backend, padded_decode=arch == "llama", num_blocks=num_blocks)
    graphs = llm.engine.runner.mixed_graphs
    assert graphs is not None and graphs.fixed_meta == (backend == "triton")
    stats = llm.final_stats  # type: ignore[attr-defined]
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_padded_mixed_with_async_scheduling() -> None:
    """Placeholder ids (the step in flight's tokens) land in the mixed graphs' buffer."""
    _check("llama", 8, async_scheduling=True)


def test_padded_mixed_with_triton_kernels_reads_the_buckets_constant_metadata() -> None:
    """The unified kernel under Triton's interpreter with each bucket's fixed metadata
    (max_query_len the bucket, the model's length, no real host-side lengths): what a
    capture records."""
    pytest.importorskip("triton")
    prompts = make_prompts(3, seed=5)
    params = [SamplingParams(max_tokens=4, temperature=0)] * 3
    kw = dict(attention_backend="triton", max_num_batched_tokens=16, num_blocks=64)
    got, steps, llm = _generate("llama", prompts, params, True, **kw)
    assert llm.engine.runner.mixed_graphs is not None
    assert llm.engine.runner.mixed_graphs.fixed_meta
    assert any(t > real for t, real in steps)
    hf = hf_model(tiny_model_dir("llama"))
    eos = llm.engine.eos_token_ids[0] if llm.engine.eos_token_ids else None
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(hf, prompt, 4, eos), prompt


@pytest.mark.parametrize("arch,backend", [("llama", "torch"), ("deepseek_v2", "triton")])
def test_tp2_padded_mixed_equals_transformers(arch: str, backend: str) -> None:
    """Every rank runs rank 0's bucket from its own mixed graphs' buffer (gloo); with
    MLA each rank's absorbed kernel takes its share of the heads."""
    if backend == "triton":
        pytest.importorskip("triton")
    _check(arch, 6, backend, tensor_parallel_size=2, num_blocks=64)


def _config(*flags: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return engine_config_from_args(p.parse_args(["--model", "/m", *flags]))


def test_graphs_only_with_a_graph_safe_backend_and_the_flags() -> None:
    cfg = _config("--device", "cuda")
    assert cfg.graph_safe_backend and cfg.use_cuda_graphs and cfg.use_mixed_graphs
    assert cfg.max_graph_tokens == 512
    # the torch reference loops over host-side lengths: nothing captured with it
    torch_cfg = _config("--device", "cuda", "--attention-backend", "torch")
    assert not torch_cfg.graph_safe_backend
    assert not torch_cfg.use_cuda_graphs and not torch_cfg.use_mixed_graphs
    off = _config("--device", "cuda", "--max-graph-tokens", "0")
    assert off.use_cuda_graphs and not off.use_mixed_graphs
    assert not _config("--device", "cuda", "--enforce-eager").use_mixed_graphs
    assert not _config("--device", "cpu").use_cuda_graphs
    with pytest.raises(ValueError, match="max_graph_tokens"):
        EngineConfig(model_dir="/m", max_graph_tokens=-1)


def test_mixed_graphs_bucket_only_steps_they_can_replay() -> None:
    """Steps over the largest bucket and steps wanting prompt logprobs run eagerly; an
    MLA model's buckets read their constant metadata (graph-safe on Triton) and take
    the steps cheaper in the latent space than decompressed: a chunk over a long cached
    prefix, not a fresh prompt."""
    llm = LLM(tiny_model_dir("deepseek_v2"), padded_mixed=True, attention_backend="triton",
              **{**ENGINE, "max_num_batched_tokens": 64})
    graphs = llm.engine.runner.mixed_graphs
    assert graphs is not None and graphs.fixed_meta and graphs.max_tokens == 64
    a = Request("a", list(range(10, 50)), SamplingParams())
    b = Request("b", list(range(10, 50)), SamplingParams(prompt_logprobs=1))
    a.num_computed_tokens = 20
    b.num_computed_tokens = 20

    def bucket(*rows: ScheduledRequest) -> int | None:
        """The bucket of a step of `rows` (the plan the persistent batch would make)."""
        starts = [s.request.num_computed_tokens for s in rows]
        cols = np.zeros((6, len(rows)), np.int64)
        cols[1] = starts  # tokens computed before the step
        plan = StepPlan(rows, np.arange(len(rows)), np.array([s.num_new_tokens for s in rows]),
                        cols, False, 0, 0)
        return graphs.bucket_for_plan(
            plan, any(s.request.wants_prompt_logprobs for s in rows))

    assert bucket(ScheduledRequest(a, 2)) == 2
    assert bucket(ScheduledRequest(a, 40), ScheduledRequest(a, 30)) is None
    assert bucket(ScheduledRequest(b, 2)) is None
    fresh = Request("c", list(range(10, 50)), SamplingParams())
    assert bucket(ScheduledRequest(fresh, 30)) is None
    # a fresh chunk beside enough decode rows of long contexts: cheaper absorbed in all
    rows = [ScheduledRequest(a, 1) for _ in range(3)]
    assert bucket(ScheduledRequest(fresh, 4), *rows) == 8
    llm.engine.close()
