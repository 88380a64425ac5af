"""DeepSeek-V2 / V3 (MLA + MoE) against transformers: greedy token-identical through
chunked prefill, prefix-cache hits and preemption, logits within float32 noise, the
latent cache's shape and bytes, and the config errors a user can hit."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from engine.attention import AttentionMetadata
from engine.config import ModelConfig, ModelDirError
from engine.llm import LLM
from engine.models.loader import load_model
from engine.sampling_params import SamplingParams
from kvtransfer.layout import KVLayout
from tests.factories import hf_greedy, hf_model, tiny_model_dir
from tests.unit.engine.test_correctness import MAX_TOKENS, make_prompts

YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=256, beta_fast=32,
            beta_slow=1, mscale=0.707, mscale_all_dim=0.707)
VARIANTS = {
    # greedy softmax top-2, no q LoRA, plain rope
    "v2": ("deepseek_v2", {}),
    # q LoRA, group-limited top-3 of 4 groups, routed_scaling_factor, yarn rope + mscale
    "v2-lora-groups-yarn": ("deepseek_v2", dict(
        q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        num_experts_per_tok=3, routed_scaling_factor=1.5, rope_scaling=YARN)),
    # sigmoid + correction bias, top-4 in 2 of 4 groups, renormalised, q LoRA
    "v3": ("deepseek_v3", dict(q_lora_rank=24, n_group=4, topk_group=2,
                               num_experts_per_tok=4, norm_topk_prob=True)),
    # rotate-half rope, no q LoRA, no renormalisation, 16 experts
    "v3-halfrope": ("deepseek_v3", dict(rope_interleave=False, n_routed_experts=16,
                                        n_group=2, topk_group=1, norm_topk_prob=False)),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def ds_model(request):
    arch, kw = VARIANTS[request.param]
    d = tiny_model_dir(arch, **kw)
    return d, hf_model(d)


def test_greedy_matches_transformers_through_chunking_prefix_hits_and_preemption(ds_model):
    model_dir, hf = ds_model
    llm = LLM(model_dir, dtype="float32", block_size=4, num_blocks=40,
              max_num_batched_tokens=32)
    prompts = make_prompts(10)
    assert max(len(p) for p in prompts) > 32
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    eos = llm.engine.eos_token_ids[0]
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, MAX_TOKENS, eos), prompt
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    llm.engine.check_integrity()
    assert stats.num_free_blocks == stats.num_blocks


def test_logits_match_transformers(ds_model):
    model_dir, hf = ds_model
    cfg = ModelConfig.from_model_dir(model_dir)
    model = load_model(model_dir, cfg, torch.float32, torch.device("cpu"))
    ids = make_prompts(1, seed=3)[0] + list(range(20, 40))
    n, bs = len(ids), 4
    nb = -(-n // bs)
    assert cfg.mla is not None
    cache = torch.zeros(nb, cfg.num_layers, 1, bs, 1, cfg.mla.latent_dim)
    pos = torch.arange(n)
    meta = AttentionMetadata(
        num_seqs=1, num_tokens=n, slot_mapping=pos, query_start_loc=torch.tensor([0, n]),
        seq_lens=torch.tensor([n]), block_tables=torch.arange(nb)[None], max_query_len=n,
        max_seq_len=n, query_start_loc_cpu=[0, n], seq_lens_cpu=[n])
    with torch.inference_mode():
        ours = model.compute_logits(model(torch.tensor(ids), pos, cache, meta))
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4


def test_latent_cache_and_layout():
    d = tiny_model_dir("deepseek_v2")
    llm = LLM(d, dtype="float32", block_size=16, num_blocks=8)
    cfg = llm.engine.model_config
    assert cfg.mla is not None and cfg.routing is not None and cfg.sparse_layers == (1, 2)
    # one latent (kv_lora_rank) + rope key (qk_rope_head_dim) per token per layer
    assert tuple(llm.engine.runner.kv_cache.shape) == (8, 3, 1, 16, 1, 32 + 16)
    from kvtransfer.layout import engine_layout

    layout = engine_layout(llm.engine.config)
    assert layout.name == "mla_latent_v1"
    assert layout.tensor_shape(8) == tuple(llm.engine.runner.kv_cache.shape)
    assert layout.token_bytes == (32 + 16) * 3 * 4
    assert layout.block_bytes == layout.token_bytes * 16
    with pytest.raises(Exception, match="name"):
        layout.check_same(KVLayout(num_layers=3, num_kv_heads=1, head_dim=48, block_size=16,
                                   dtype="float32"))
    with pytest.raises(ValueError, match="num_kv_heads 1"):
        KVLayout(num_layers=3, num_kv_heads=2, head_dim=48, block_size=16, dtype="float32",
                 name="mla_latent_v1")


def test_dense_first_layers_and_expert_layers_load_from_per_expert_tensors():
    d = tiny_model_dir("deepseek_v3", q_lora_rank=24, n_group=4, topk_group=2)
    cfg = ModelConfig.from_model_dir(d)
    model = load_model(d, cfg, torch.float32, torch.device("cpu"))
    hf = hf_model(d)
    layers = model.model.layers
    assert not hasattr(layers[0].mlp, "w13")  # first_k_dense_replace = 1
    sd = hf.state_dict()
    w13 = layers[1].mlp.w13
    # transformers stacks gate_up the same way: [E, 2I, H], gate rows first
    torch.testing.assert_close(w13, sd["model.layers.1.mlp.experts.gate_up_proj"])
    torch.testing.assert_close(layers[2].mlp.gate.e_score_correction_bias,
                               sd["model.layers.2.mlp.gate.e_score_correction_bias"])
    assert layers[2].mlp.gate.e_score_correction_bias.abs().sum() > 0


def test_config_errors(tmp_path):
    src = tiny_model_dir("deepseek_v2")
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    bad = dict(cfg)
    del bad["kv_lora_rank"]
    with pytest.raises(ModelDirError, match="kv_lora_rank"):
        ModelConfig.from_dict(bad)
    with pytest.raises(ModelDirError, match="num_experts_per_tok"):
        ModelConfig.from_dict({**cfg, "num_experts_per_tok": 9})
    llama = tiny_model_dir("llama")
    with open(os.path.join(llama, "config.json")) as f:
        lcfg = json.load(f)
    with pytest.raises(ModelDirError, match="yarn"):
        ModelConfig.from_dict({**lcfg, "rope_parameters": {
            **YARN, "rope_type": "yarn", "rope_theta": 10000.0}})
    # a missing expert tensor is named
    d = tmp_path / "m"
    shutil.copytree(src, d)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ModelDirError, match="layers.2.mlp.w13"):
        load_model(str(d), ModelConfig.from_model_dir(str(d)), torch.float32,
                   torch.device("cpu"))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_latent_blocks_hit_from_the_host_and_disk_tiers(tier, tmp_path):
    """Device pressure evicts DeepSeek's latent blocks; the reruns load them back from
    the tier (bytes = hits x the latent layout's block bytes) and stay transformers'
    greedy tokens."""
    import random

    from kvtransfer.tiers import TierConfig
    from kvtransfer.tiers.manager import TieredCache
    from tests.unit.engine.test_offload import MAX_TOKENS as N
    from tests.unit.engine.test_offload import layout_of, run_twice

    d = tiny_model_dir("deepseek_v2")
    hf = hf_model(d)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(26)] for _ in range(4)]
    eos = hf.generation_config.eos_token_id
    ref = [hf_greedy(hf, p, N, eos) for p in prompts]
    layout = layout_of(d)
    assert layout.name == "mla_latent_v1" and layout.token_bytes == (32 + 16) * 3 * 4
    cfg = (TierConfig(host_blocks=64) if tier == "host"
           else TierConfig(disk_dir=str(tmp_path), disk_blocks=64))
    with TieredCache(cfg, layout) as tiers:
        run_twice((d, prompts, ref), tiers, tier)
