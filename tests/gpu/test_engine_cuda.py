"""The engine on CUDA (skipped without a GPU): Triton attention and elementwise
kernels, decode steps replayed from CUDA graphs, the KV pool sized from free memory,
dummy weights for the shipped model shapes."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.factories import ARCHS, DEEPSEEK_ARCHS, hf_greedy, hf_model, tiny_model_dir

pytestmark = pytest.mark.gpu


def _prompts() -> list[list[int]]:
    # Ragged, longer than one prefill chunk, and sharing a prefix (prefix-cache hits).
    base = [(11 * j) % 400 + 5 for j in range(40)]
    return [base + [(3 * i + j) % 300 + 7 for j in range(n)]
            for i, n in enumerate((3, 17, 60, 9, 33, 1, 80, 25))]


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", ARCHS + DEEPSEEK_ARCHS)
def test_float32_on_cuda_equals_transformers(arch: str, eager: bool) -> None:
    d = tiny_model_dir(arch, **({"sliding_window": 48} if arch in ("mistral", "mixtral") else {}))
    # Few blocks: the batch does not fit, so requests are preempted and recomputed.
    llm = LLM(d, dtype="float32", device="cuda", num_blocks=40, block_size=16,
              max_num_seqs=8, max_num_batched_tokens=64, enforce_eager=eager)
    assert (llm.engine.runner.graphs is None) == eager
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    hf = hf_model(d)
    eos = llm.engine.eos_token_ids[0] if llm.engine.eos_token_ids else None
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 16, eos), (arch, eager, len(p))
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    llm.engine.check_integrity()
    assert stats.num_free_blocks == stats.num_blocks


def test_bfloat16_logits_close_to_transformers() -> None:
    d = tiny_model_dir("llama", dtype="bfloat16")
    llm = LLM(d, dtype="bfloat16", device="cuda", num_blocks=32)
    prompt = _prompts()[2]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    ours = llm.generate([prompt], params)[0].logprobs[0]
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").cuda().eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt], device="cuda")).logits[0, -1].float().log_softmax(-1)
    # bf16 has 8 bits of mantissa: the two stacks round differently inside every op.
    for tok, lp in ours.items():
        assert abs(lp - ref[tok].item()) < 0.1, (tok, lp, ref[tok].item())


def test_kv_pool_sized_from_gpu_memory_utilization() -> None:
    d = tiny_model_dir("llama")
    small = LLM(d, dtype="float32", device="cuda", gpu_memory_utilization=0.3)
    n_small = small.engine.runner.num_blocks
    del small
    gc.collect()  # whatever of the first engine sits in a reference cycle goes too
    torch.cuda.empty_cache()
    big = LLM(d, dtype="float32", device="cuda", gpu_memory_utilization=0.5)
    assert big.engine.runner.num_blocks > n_small * 1.3
    free, total = torch.cuda.mem_get_info()
    assert total - free <= 0.55 * total


@pytest.mark.parametrize("shape", ["llama3.2-1b", "qwen3-0.6b", "llama3-8b", "qwen3-30b-a3b",
                                   "deepseek-v2-lite"])
def test_dummy_load_format_for_every_shipped_shape(shape: str) -> None:
    from engine.model_shapes import model_shape_dir

    llm = LLM(model_shape_dir(shape), dtype="bfloat16", device="cuda", load_format="dummy",
              num_blocks=64, max_num_seqs=4, max_model_len=1024)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0,
                                                      ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    del llm
    torch.cuda.empty_cache()
