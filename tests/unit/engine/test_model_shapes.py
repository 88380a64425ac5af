"""Shipped model shapes, `load_format="dummy"` and the engine CLI flags that select them.

The full shapes are built on the meta device only (no 8B parameters on a CPU); a
reduced copy of each (1 layer, hidden 64, small vocab, the shape's own heads, head_dim,
RoPE, tying and q/k norm) is materialised and runs through the engine.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

from bench.engine_roofline import ModelCost
from engine.cli import add_engine_arguments, engine_config_from_args, parse_bytes
from engine.config import ModelConfig, ModelDirError
from engine.llm import LLM
from engine.model_shapes import MODEL_SHAPES, load_shape, model_shape_dir
from engine.models.loader import load_model
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

# Published parameter counts (Hugging Face model cards / safetensors metadata).
PUBLISHED_PARAMS = {"llama3-8b": 8_030_261_248, "llama3.2-1b": 1_235_814_400,
                    "qwen3-0.6b": 596_049_920, "qwen3-30b-a3b": 30_532_122_624,
                    "mixtral-8x7b": 46_702_792_704, "deepseek-v2-lite": 15_706_484_224}


def reduced(name: str, root: str) -> str:
    """A config.json of shape `name` made small enough to run on a CPU in a test."""
    cfg = load_shape(name)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg |= {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
            "vocab_size": 1024, "torch_dtype": "float32"}
    if "moe_intermediate_size" in cfg:
        cfg["moe_intermediate_size"] = 32
    if "kv_lora_rank" in cfg:  # MLA; a second layer, so a MoE layer follows the dense one
        cfg |= {"num_hidden_layers": 2, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 16, "v_head_dim": 16}
    path = os.path.join(root, f"{name}-reduced.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


@pytest.mark.parametrize("name", MODEL_SHAPES)
def test_full_shape_builds_on_meta_with_the_published_size(name):
    cfg = ModelConfig.from_dict(load_shape(name))
    model = load_model("unused", cfg, torch.bfloat16, torch.device("meta"), "dummy")
    n = sum(p.numel() for p in model.parameters())  # a tied tensor counts once
    assert n == PUBLISHED_PARAMS[name] == ModelCost.from_config(cfg, 2).params
    assert cfg.dtype == "bfloat16"
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_shape_features():
    l8, l1, q, qm, mx, ds = (ModelConfig.from_dict(load_shape(n)) for n in MODEL_SHAPES)
    assert ds.mla is not None and ds.routing is not None
    assert (ds.mla.kv_lora_rank, ds.mla.qk_rope_head_dim, ds.num_experts,
            ds.num_experts_per_tok, ds.routing.n_shared_experts) == (512, 64, 64, 6, 2)
    assert ds.sparse_layers == tuple(range(1, 27)) and ds.rope.rope_type == "yarn"
    # the latent cache: 576 values per token per layer, 27 layers, bfloat16
    assert ModelCost.from_config(ds, 2).kv_bytes_per_token == 576 * 27 * 2
    assert (l8.num_layers, l8.hidden_size, l8.num_heads, l8.num_kv_heads, l8.rope.theta) == (
        32, 4096, 32, 8, 500000.0)
    assert l1.rope.rope_type == "llama3" and l1.rope.factor == 32 and l1.tie_word_embeddings
    assert q.qk_norm and q.tie_word_embeddings and q.head_dim == 128 and q.rope.theta == 1e6
    assert qm.qk_norm and (qm.num_experts, qm.num_experts_per_tok, qm.moe_intermediate_size,
                           qm.norm_topk_prob) == (128, 8, 768, True)
    assert qm.sparse_layers == tuple(range(48)) and not l8.sparse_layers
    assert (mx.num_experts, mx.num_experts_per_tok, mx.moe_intermediate_size) == (8, 2, 14336)
    assert mx.norm_topk_prob and mx.sliding_window is None and not mx.qk_norm


def test_moe_roofline_counts_the_experts_a_step_reads():
    """Qwen3-30B-A3B: 3.3B parameters per token (the "A3B") of 30.5B; a decode step of one
    token reads 8 of 128 experts, a large batch all of them."""
    cost = ModelCost.from_config(ModelConfig.from_dict(load_shape("qwen3-30b-a3b")), 2)
    active = cost.layer_params + cost.head_params + cost.embed_params + cost.norm_params
    assert 3.3e9 < active < 3.4e9
    assert cost.active_experts(1) == pytest.approx(8)
    assert cost.weight_bytes_for(1) == 2 * (cost.layer_params + cost.head_params
                                            + cost.norm_params)
    assert cost.weight_bytes_for(4096) == pytest.approx(cost.weight_bytes, rel=1e-6)
    assert cost.weight_bytes_for(1) < cost.weight_bytes_for(16) < cost.weight_bytes
    assert cost.step_bytes(10, 1) == cost.weight_bytes_for(1) + 10 * cost.kv_bytes_per_token


@pytest.mark.parametrize("name", MODEL_SHAPES)
def test_reduced_shape_runs_with_dummy_weights(name, tmp_path):
    d = model_shape_dir(reduced(name, str(tmp_path)), cache_root=str(tmp_path / "cache"))
    assert not any(f.endswith(".safetensors") for f in os.listdir(d))
    llm = LLM(d, dtype="float32", load_format="dummy", num_blocks=16)
    out = llm.generate([llm.tokenizer.encode("The quick brown fox")],
                       SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and all(0 <= t < 1024 for t in out.token_ids)
    llm.engine.check_integrity()


def test_dummy_weights_are_deterministic_tied_and_scaled(tmp_path):
    cfg = ModelConfig.from_model_dir(model_shape_dir(reduced("qwen3-0.6b", str(tmp_path)),
                                                     cache_root=str(tmp_path)))
    a = load_model("unused", cfg, torch.float32, torch.device("cpu"), "dummy", seed=3)
    b = load_model("unused", cfg, torch.float32, torch.device("cpu"), "dummy", seed=3)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert a.lm_head.weight is a.model.embed_tokens.weight
    w = a.model.layers[0].mlp.gate_up_proj.weight
    assert 0.015 < float(w.detach().std()) < 0.025 and abs(float(w.detach().mean())) < 0.002
    assert torch.equal(a.model.layers[0].self_attn.q_norm.weight, torch.ones(cfg.head_dim))


def test_shape_dir_has_no_weights_without_dummy(tmp_path):
    d = model_shape_dir(reduced("llama3-8b", str(tmp_path)), cache_root=str(tmp_path))
    with pytest.raises(ModelDirError, match="load-format dummy"):
        load_model(d, ModelConfig.from_model_dir(d), torch.float32, torch.device("cpu"))


def test_shape_dir_tokens_match_the_embedded_tokenizer_and_are_cached(tmp_path):
    root = str(tmp_path)
    d = model_shape_dir("llama3-8b", cache_root=root)
    assert d == os.path.join(root, "llama3-8b")
    cfg, tok = ModelConfig.from_model_dir(d), Tokenizer(d)
    assert tok.eos_token_id in cfg.eos_token_ids and cfg.bos_token_id == tok.encode("x")[0]
    assert cfg.vocab_size == 128256 and tok.vocab_size < cfg.vocab_size
    mtime = os.stat(os.path.join(d, "config.json")).st_mtime_ns
    assert model_shape_dir("llama3-8b", cache_root=root) == d
    assert os.stat(os.path.join(d, "config.json")).st_mtime_ns == mtime  # not rebuilt
    with open(os.path.join(d, "config.json"), "w") as f:  # stale data is replaced
        json.dump({**load_shape("llama3-8b"), "num_hidden_layers": 2}, f)
    assert ModelConfig.from_model_dir(model_shape_dir("llama3-8b", cache_root=root)
                                      ).num_layers == 32
    assert not [n for n in os.listdir(root) if n.startswith(".")]  # no leftovers


def test_unknown_shape_is_a_clear_error():
    with pytest.raises(ModelDirError, match="llama3-8b"):
        load_shape("llama-9000")


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return p.parse_args(list(argv))


def test_cli_model_shape_implies_dummy(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = engine_config_from_args(parse(
        "--model-shape", "qwen3-0.6b", "--device", "cuda", "--kv-cache-memory", "4GiB",
        "--gpu-memory-utilization", "0.8", "--enforce-eager", "--attention-backend", "torch"))
    assert cfg.load_format == "dummy" and os.path.basename(cfg.model_dir) == "qwen3-0.6b"
    assert "--load-format dummy" in capsys.readouterr().err
    assert (cfg.cache.kv_cache_memory_bytes, cfg.cache.gpu_memory_utilization) == (4 << 30, 0.8)
    assert cfg.enforce_eager and cfg.backend == "torch" and not cfg.use_cuda_graphs
    with pytest.raises(SystemExit, match="only with --load-format dummy"):
        engine_config_from_args(parse("--model-shape", "qwen3-0.6b", "--load-format", "auto"))


def test_cli_defaults_and_exclusive_model_flags(capsys):
    args = parse("--model", "/m", "--device", "cuda")
    cfg = engine_config_from_args(args)
    assert (cfg.load_format, cfg.backend, cfg.use_cuda_graphs) == ("auto", "triton", True)
    assert (cfg.cache.gpu_memory_utilization, cfg.cache.kv_cache_memory_bytes) == (0.9, None)
    assert engine_config_from_args(parse("--model", "/m", "--load-format", "dummy")
                                   ).load_format == "dummy"
    with pytest.raises(SystemExit):
        parse("--model", "/m", "--model-shape", "llama3-8b")
    with pytest.raises(SystemExit):
        parse("--model-shape", "llama-9000")


def test_parse_bytes():
    assert [parse_bytes(s) for s in ("4GiB", "512MiB", "2GB", "1073741824", "1.5 gib")] == [
        4 << 30, 512 << 20, 2 * 10**9, 1 << 30, 3 << 29]
    for bad in ("lots", "-1GiB", "4XB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)


def test_device_and_dtype_auto(monkeypatch):
    """auto: cuda when visible (the model's own dtype there), else cpu in float32."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = engine_config_from_args(parse("--model-shape", "llama3-8b"))
    assert (cfg.device, cfg.dtype) == ("cpu", "float32")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = engine_config_from_args(parse("--model-shape", "llama3-8b"))
    assert (cfg.device, cfg.dtype) == ("cuda", None)  # None: config.json's bfloat16
    cfg = engine_config_from_args(parse("--model-shape", "llama3-8b", "--dtype", "float16"))
    assert (cfg.device, cfg.dtype) == ("cuda", "float16")
    cfg = engine_config_from_args(parse("--model", "/m", "--device", "cpu", "--dtype", "auto"))
    assert (cfg.device, cfg.dtype) == ("cpu", "float32")
