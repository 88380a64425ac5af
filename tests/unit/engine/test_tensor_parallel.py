"""Tensor parallelism on CPU (gloo, float32): greedy output token-identical to
transformers for every architecture through chunked prefill, prefix-cache hits and
preemption, with the ranks as real processes."""

import pytest
import torch

from engine.config import ModelConfig, ModelDirError
from engine.llm import LLM
from engine.models.parallel_layers import kv_head_range, shard_range
from engine.sampling_params import SamplingParams
from tests.factories import hf_greedy, hf_model, tiny_model_dir
from tests.unit.engine.test_correctness import MAX_TOKENS, make_prompts

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 10000.0}

CASES = {
    # llama3 RoPE scaling; a vocabulary that does not split evenly (the padded shard)
    "llama": dict(rope_scaling=LLAMA3_ROPE, vocab_pad=1),
    "qwen2": {},  # qkv bias
    "qwen3": dict(tie=True),  # q/k norms; tied embeddings share the vocab shard
    "mistral": dict(num_key_value_heads=1),  # one KV head: replicated on both ranks
}


def _run(model_dir: str, tp: int) -> None:
    hf = hf_model(model_dir)
    # 40 blocks of 4 tokens cannot hold 10 prompts of up to ~70 tokens + 16 outputs:
    # the scheduler must preempt; a 32-token budget chunks the longer prompts.
    llm = LLM(model_dir, dtype="float32", block_size=4, num_blocks=40,
              max_num_batched_tokens=32, tensor_parallel_size=tp)
    try:
        prompts = make_prompts(10)
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        llm.engine.check_integrity()
        eos = llm.engine.eos_token_ids[0]
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(hf, prompt, MAX_TOKENS, eos), prompt
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert stats.num_free_blocks == stats.num_blocks
        # parallel samples (a block copy on every rank) and prompt logprobs (logits of
        # prompt rows) run along on the other ranks too
        p = make_prompts(1, seed=7)[0]
        lp = llm.generate([p], SamplingParams(max_tokens=4, temperature=0, n=2,
                                              prompt_logprobs=1))
        ref = hf_greedy(hf, p, 4, eos)
        assert [o.token_ids for o in lp] == [ref, ref]
        with torch.no_grad():
            ref_lp = hf(torch.tensor([p])).logits[0].float().log_softmax(-1)
        got = lp[0].prompt_logprobs or []
        assert len(got) == len(p) - 1
        for i, scores in enumerate(got):  # position i scores prompt token i + 1
            assert abs(scores[p[i + 1]] - ref_lp[i, p[i + 1]].item()) < 1e-4
        llm.engine.check_integrity()
    finally:
        llm.engine.close()
    procs = llm.engine.runner.tp.procs
    assert all(not proc.is_alive() for proc in procs)


@pytest.mark.parametrize("arch", list(CASES))
def test_tp2_greedy_matches_transformers(arch):
    kw = dict(CASES[arch])
    _run(tiny_model_dir(arch, **kw), 2)


def test_tp4_greedy_matches_transformers():
    # 4 heads and 2 KV heads over 4 ranks: each KV head on two ranks
    _run(tiny_model_dir("qwen2"), 4)


def test_shard_ranges_cover_each_tensor_once():
    cfg = ModelConfig.from_model_dir(tiny_model_dir("mistral", num_key_value_heads=1))
    assert [kv_head_range(cfg, r, 2) for r in range(2)] == [(0, 1), (0, 1)]
    q = [shard_range(cfg, "model.layers.0.self_attn.q_proj.weight", r, 2) for r in range(2)]
    assert q == [(0, 0, 32), (0, 32, 64)]
    assert shard_range(cfg, "model.layers.0.mlp.down_proj.weight", 1, 2) == (1, 64, 128)
    assert shard_range(cfg, "model.norm.weight", 1, 2) is None


def test_tp_refuses_a_model_it_cannot_split():
    cfg = ModelConfig.from_model_dir(tiny_model_dir("llama"))
    with pytest.raises(ModelDirError, match="tensor parallel size 3 does not divide"):
        cfg.check_tensor_parallel(3)
    with pytest.raises(ModelDirError, match="8 attention heads|4 attention heads"):
        LLM(tiny_model_dir("llama"), dtype="float32", num_blocks=8, tensor_parallel_size=8)
    assert torch.get_num_threads() >= 1
