"""Tensor parallelism on CUDA (NCCL): TP 2 greedy output token-identical to
transformers' for each architecture (mixtures of experts and MLA too), float32, through chunked prefill, prefix hits and
preemption. Needs two GPUs (skipped on fewer: a one-GPU machine runs none of these)."""

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
