"""Tensor parallelism on CUDA (NCCL): TP 2 greedy output token-identical to
transformers' for each architecture (mixtures of experts and MLA too), float32, through
chunked prefill, prefix hits and preemption; CUDA graphs captured on both ranks
replay decode steps, token-identical to eager TP. Needs two GPUs (skipped on fewer: a
one-GPU machine runs none of these)."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.factories import ARCHS, DEEPSEEK_ARCHS, hf_greedy, hf_model, tiny_model_dir
from tests.unit.engine.test_correctness import MAX_TOKENS, make_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]


@pytest.mark.parametrize("arch", ARCHS + DEEPSEEK_ARCHS)
def test_tp2_on_two_gpus_matches_transformers(arch: str) -> None:
    d = tiny_model_dir(arch, **({"num_key_value_heads": 1} if arch == "mistral" else {}))
    hf = hf_model(d)
    llm = LLM(d, dtype="float32", device="cuda", block_size=4, num_blocks=40,
              max_num_batched_tokens=32, tensor_parallel_size=2)
    try:
        prompts = make_prompts(10)
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        eos = llm.engine.eos_token_ids[0]
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == hf_greedy(hf, prompt, MAX_TOKENS, eos), prompt
        assert llm.engine.stats().num_preemptions > 0
        llm.engine.check_integrity()
        assert str(llm.engine.runner.device) == "cuda:0"
    finally:
        llm.engine.close()


def test_tp2_cuda_graphs_capture_the_collectives() -> None:
    """Both ranks capture every bucket (the all-reduces and the logits' all-gather inside
    the graphs) and replay rank 0's bucket each decode step: greedy output identical to
    eager TP 2 and to transformers'."""
    d = tiny_model_dir("llama")
    hf = hf_model(d)
    prompts = make_prompts(6)
    outs: dict[bool, list[list[int]]] = {}
    replays: list[int] = []
    for eager in (True, False):
        llm = LLM(d, dtype="float32", device="cuda", block_size=4, num_blocks=64,
                  max_num_seqs=8, max_num_batched_tokens=32, tensor_parallel_size=2,
                  enforce_eager=eager, collective_timeout_s=60)
        try:
            graphs = llm.engine.runner.graphs
            if eager:
                assert graphs is None
            else:
                assert graphs is not None and sorted(graphs._graphs) == graphs.buckets
                graphs.run = (  # type: ignore[method-assign]
                    lambda b, step, run=graphs.run: replays.append(b) or run(b, step))
            got = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
            outs[eager] = [o.token_ids for o in got]
            llm.engine.check_integrity()
            eos = llm.engine.eos_token_ids[0]
        finally:
            llm.engine.close()
    assert replays and any(b > 1 for b in replays)
    for prompt, g, e in zip(prompts, outs[False], outs[True], strict=True):
        assert g == e == hf_greedy(hf, prompt, MAX_TOKENS, eos), prompt
