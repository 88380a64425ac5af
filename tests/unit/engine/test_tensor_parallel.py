"""Tensor parallelism on CPU (gloo, float32): greedy output token-identical to
transformers for every architecture through chunked prefill, prefix-cache hits and
preemption, with the ranks as real processes."""

from dataclasses import replace
from typing import Any

import pytest
import torch

from engine.config import ModelConfig, ModelDirError
from engine.distributed import TPGroup
from engine.llm import LLM
from engine.models.loader import load_model
from engine.models.parallel_layers import kv_head_range, shard_range, vocab_shard
from engine.sampling_params import SamplingParams
from tests.factories import hf_greedy, hf_model, tiny_model_dir
from tests.unit.engine.test_correctness import MAX_TOKENS, make_prompts

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 10000.0}

CASES: dict[str, dict[str, Any]] = {
    # llama3 RoPE scaling; a vocabulary that does not split evenly (the padded shard)
    "llama": dict(rope_scaling=LLAMA3_ROPE, vocab_pad=1),
    "qwen2": {},  # qkv bias
    "qwen3": dict(tie=True),  # q/k norms; tied embeddings share the vocab shard
    "mistral": dict(num_key_value_heads=1),  # one KV head: replicated on both ranks
    # 16 experts top-4 split along their intermediate size; a dense mlp_only layer
    "qwen3_moe": {},
    "mixtral": dict(vocab_pad=1),  # 8 experts top-2 (w1 / w3 / w2 names)
    # MLA: query heads split, the latent replicated; a dense first layer, shared experts
    "deepseek_v2": {},
    # q LoRA (q_a replicated, q_b split), sigmoid group-limited routing
    "deepseek_v3": dict(q_lora_rank=24, n_group=4, topk_group=2, num_experts_per_tok=4,
                        norm_topk_prob=True),
}


def _run(model_dir: str, tp: int, n_prompts: int = 10, num_blocks: int = 40) -> None:
    hf = hf_model(model_dir)
    # 40 blocks of 4 tokens cannot hold 10 prompts of up to ~70 tokens + 16 outputs:
    # the scheduler must preempt; a 32-token budget chunks the longer prompts.
    llm = LLM(model_dir, dtype="float32", block_size=4, num_blocks=num_blocks,
              max_num_batched_tokens=32, tensor_parallel_size=tp)
    try:
        prompts = make_prompts(n_prompts)
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
    group = llm.engine.runner.tp
    assert group is not None and group.procs
    assert all(not proc.is_alive() for proc in group.procs)


@pytest.mark.parametrize("arch", list(CASES))
def test_tp2_greedy_matches_transformers(arch):
    kw = dict(CASES[arch])
    _run(tiny_model_dir(arch, **kw), 2)


def test_tp4_greedy_matches_transformers():
    # 4 heads and 2 KV heads over 4 ranks: each KV head on two ranks
    _run(tiny_model_dir("qwen2"), 4, n_prompts=5, num_blocks=24)


def test_shard_ranges_cover_each_tensor_once():
    cfg = ModelConfig.from_model_dir(tiny_model_dir("mistral", num_key_value_heads=1))
    assert [kv_head_range(cfg, r, 2) for r in range(2)] == [(0, 1), (0, 1)]
    q = [shard_range(cfg, "model.layers.0.self_attn.q_proj.weight", r, 2) for r in range(2)]
    assert q == [(0, 0, 32), (0, 32, 64)]
    assert shard_range(cfg, "model.layers.0.mlp.down_proj.weight", 1, 2) == (1, 64, 128)
    assert shard_range(cfg, "model.norm.weight", 1, 2) is None


def test_each_rank_loads_only_its_slices():
    """Both ranks' parameters against the whole model's: columns / rows of each fused
    projection, the replicated KV head, the last vocab shard's zero padding, dummy
    shards (no collective runs while loading: the group is never called)."""
    d = tiny_model_dir("mistral", num_key_value_heads=1, vocab_pad=1)
    cfg = ModelConfig.from_model_dir(d)
    cpu = torch.device("cpu")
    full = dict(load_model(d, cfg, torch.float32, cpu).named_parameters())
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.head_dim, cfg.intermediate_size
    rows = vocab_shard(cfg.vocab_size, 2)
    assert cfg.vocab_size % 2 == 1
    for r in range(2):
        tp = TPGroup(r, 2, cpu, None, 1.0)
        part = dict(load_model(d, cfg, torch.float32, cpu, tp=tp).named_parameters())
        fq, fk, fv = full["model.layers.0.self_attn.qkv_proj.weight"].split([q, kv, kv])
        pq, pk, pv = part["model.layers.0.self_attn.qkv_proj.weight"].split(
            [q // 2, kv, kv])
        assert torch.equal(pq, fq[r * q // 2:(r + 1) * q // 2])
        assert torch.equal(pk, fk) and torch.equal(pv, fv)  # the one KV head, replicated
        fo = full["model.layers.0.self_attn.o_proj.weight"]
        assert torch.equal(part["model.layers.0.self_attn.o_proj.weight"],
                           fo[:, r * q // 2:(r + 1) * q // 2])
        fg, fu = full["model.layers.1.mlp.gate_up_proj.weight"].split(inter)
        pg, pu = part["model.layers.1.mlp.gate_up_proj.weight"].split(inter // 2)
        sl = slice(r * inter // 2, (r + 1) * inter // 2)
        assert torch.equal(pg, fg[sl]) and torch.equal(pu, fu[sl])
        emb = part["model.embed_tokens.weight"]
        real = full["model.embed_tokens.weight"][r * rows:(r + 1) * rows]
        assert torch.equal(emb[:len(real)], real) and not emb[len(real):].any()
        dummy = dict(load_model(d, cfg, torch.float32, cpu, "dummy", tp=tp).named_parameters())
        assert {k: v.shape for k, v in dummy.items()} == {k: v.shape for k, v in part.items()}


def test_tp_refuses_a_model_it_cannot_split():
    cfg = ModelConfig.from_model_dir(tiny_model_dir("llama"))
    with pytest.raises(ModelDirError, match="tensor parallel size 3 does not divide"):
        cfg.check_tensor_parallel(3)
    with pytest.raises(ModelDirError, match="size 8 does not divide the model's 4 attention"):
        LLM(tiny_model_dir("llama"), dtype="float32", num_blocks=8, tensor_parallel_size=8)


def _cols(t: torch.Tensor, r: int, n: int) -> torch.Tensor:
    return t[..., r * n:(r + 1) * n]


def test_each_rank_loads_only_its_expert_and_mla_slices():
    """Both ranks' MoE and MLA parameters against the whole model's: every expert's
    gate / up rows and down columns, the router whole, the shared experts and the dense
    first layer split, q_b / kv_b rows and o_proj columns by head, the latent
    projections (q_a, kv_a, their norms) whole; dummy shards have the same shapes."""
    d = tiny_model_dir("deepseek_v3", q_lora_rank=24, n_group=4, topk_group=2,
                       num_experts_per_tok=4, norm_topk_prob=True)
    cfg = ModelConfig.from_model_dir(d)
    assert cfg.mla is not None and cfg.routing is not None
    cpu = torch.device("cpu")
    full = dict(load_model(d, cfg, torch.float32, cpu).named_parameters())
    heads = cfg.num_heads // 2
    qk = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim
    kvb = cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim
    inter, dense = cfg.moe_intermediate_size, cfg.intermediate_size
    shared = inter * cfg.routing.n_shared_experts
    dummies = []
    for r in range(2):
        tp = TPGroup(r, 2, cpu, None, 1.0)
        part = dict(load_model(d, cfg, torch.float32, cpu, tp=tp).named_parameters())
        att = "model.layers.1.self_attn."
        rows = slice(r * heads * qk, (r + 1) * heads * qk)
        assert torch.equal(part[att + "q_b_proj.weight"], full[att + "q_b_proj.weight"][rows])
        rows = slice(r * heads * kvb, (r + 1) * heads * kvb)
        assert torch.equal(part[att + "kv_b_proj.weight"], full[att + "kv_b_proj.weight"][rows])
        assert torch.equal(part[att + "o_proj.weight"],
                           _cols(full[att + "o_proj.weight"], r, heads * cfg.mla.v_head_dim))
        for name in ("q_a_proj.weight", "q_a_layernorm.weight", "kv_a_proj_with_mqa.weight",
                     "kv_a_layernorm.weight"):
            assert torch.equal(part[att + name], full[att + name])
        moe = "model.layers.1.mlp."
        for name in ("gate.weight", "gate.e_score_correction_bias"):
            assert torch.equal(part[moe + name], full[moe + name])
        fg, fu = full[moe + "w13"].split(inter, dim=1)
        pg, pu = part[moe + "w13"].split(inter // 2, dim=1)
        sl = slice(r * inter // 2, (r + 1) * inter // 2)
        assert torch.equal(pg, fg[:, sl]) and torch.equal(pu, fu[:, sl])
        assert torch.equal(part[moe + "w2"], _cols(full[moe + "w2"], r, inter // 2))
        for mlp, size in ((moe + "shared_experts.", shared), ("model.layers.0.mlp.", dense)):
            fg, fu = full[mlp + "gate_up_proj.weight"].split(size)
            pg, pu = part[mlp + "gate_up_proj.weight"].split(size // 2)
            sl = slice(r * size // 2, (r + 1) * size // 2)
            assert torch.equal(pg, fg[sl]) and torch.equal(pu, fu[sl])
            assert torch.equal(part[mlp + "down_proj.weight"],
                               _cols(full[mlp + "down_proj.weight"], r, size // 2))
        dummy = dict(load_model(d, cfg, torch.float32, cpu, "dummy", tp=tp).named_parameters())
        assert {k: v.shape for k, v in dummy.items()} == {k: v.shape for k, v in part.items()}
        dummies.append(dummy)
    # dummy weights: the router and the latent projections alike on both ranks (every
    # rank routes every token alike), the split tensors each rank's own
    for name in (moe + "gate.weight", att + "kv_a_proj_with_mqa.weight", att + "q_a_proj.weight"):
        assert torch.equal(dummies[0][name], dummies[1][name])
    for name in (moe + "w13", att + "kv_b_proj.weight"):
        assert not torch.equal(dummies[0][name], dummies[1][name])


def test_mixtral_expert_names_shard_along_the_intermediate_size():
    cfg = ModelConfig.from_model_dir(tiny_model_dir("mixtral", vocab_pad=1))
    moe = "model.layers.0.block_sparse_moe."
    assert shard_range(cfg, moe + "experts.7.w1.weight", 1, 2) == (0, 24, 48)
    assert shard_range(cfg, moe + "experts.7.w3.weight", 0, 2) == (0, 0, 24)
    assert shard_range(cfg, moe + "experts.7.w2.weight", 1, 2) == (1, 24, 48)
    assert shard_range(cfg, moe + "gate.weight", 1, 2) is None


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_tp_refuses_moe_and_mla_models_it_cannot_split(arch: str) -> None:
    cfg = ModelConfig.from_model_dir(tiny_model_dir(arch))
    cfg.check_tensor_parallel(2)
    assert cfg.shard(2).moe_intermediate_size == cfg.moe_intermediate_size // 2
    with pytest.raises(ModelDirError, match="divide the model's 4 attention heads"):
        cfg.check_tensor_parallel(3)
    odd = replace(cfg, moe_intermediate_size=33)
    with pytest.raises(ModelDirError, match="expert intermediate size 33"):
        odd.check_tensor_parallel(2)
    if cfg.mla is not None:  # no KV heads to split: the latent is whole on every rank
        assert cfg.shard(2).kv_cache_dims == cfg.kv_cache_dims
