"""Builds a model from a Hugging Face directory: config.json + *.safetensors (sharded too)."""

from __future__ import annotations

import glob
import os
import re

import torch
from safetensors import safe_open

from engine.config import ModelConfig, ModelDirError
from engine.models.llama import LlamaForCausalLM, rope_inv_freq

# HF name (regex) -> (our parameter name, shard index within the fused parameter).
_FUSED = [
    (re.compile(r"(.*)\.self_attn\.q_proj\.(weight|bias)$"), r"\1.self_attn.qkv_proj.\2", 0),
    (re.compile(r"(.*)\.self_attn\.k_proj\.(weight|bias)$"), r"\1.self_attn.qkv_proj.\2", 1),
    (re.compile(r"(.*)\.self_attn\.v_proj\.(weight|bias)$"), r"\1.self_attn.qkv_proj.\2", 2),
    (re.compile(r"(.*)\.mlp\.gate_proj\.weight$"), r"\1.mlp.gate_up_proj.weight", 0),
    (re.compile(r"(.*)\.mlp\.up_proj\.weight$"), r"\1.mlp.gate_up_proj.weight", 1),
]

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _shard_sizes(cfg: ModelConfig, name: str) -> list[int]:
    if "qkv_proj" in name:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [q, kv, kv]
    return [cfg.intermediate_size, cfg.intermediate_size]


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ModelDirError(f"{model_dir!r} has no *.safetensors weight files")
    return files


def load_model(model_dir: str, cfg: ModelConfig, dtype: torch.dtype,
               device: torch.device) -> LlamaForCausalLM:
    """Returns the model in eval mode with every parameter loaded from the directory.

    Raises ModelDirError naming missing or unexpected tensors.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:  # to_empty gives each module its own tensor: re-tie
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim).to(device)
    params = dict(model.named_parameters())
    if cfg.tie_word_embeddings:
        params.pop("lm_head.weight", None)  # shares embed_tokens' tensor
    loaded: set[tuple[str, int]] = set()
    expected = {(n, i) for n in params for i in range(
        len(_shard_sizes(cfg, n)) if ("qkv_proj" in n or "gate_up" in n) else 1)}
    unexpected = []
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if "rotary_emb" in key:
                    continue
                if cfg.tie_word_embeddings and key == "lm_head.weight":
                    continue
                target, shard = _map_name(key)
                param = params.get(target)
                if param is None:
                    unexpected.append(key)
                    continue
                _copy_in(param, f.get_tensor(key), cfg, target, shard)
                loaded.add((target, shard))
    missing = sorted({n for n, _ in expected - loaded})
    if missing:
        raise ModelDirError(f"weights missing from {model_dir!r}: {missing[:8]}")
    if unexpected:
        raise ModelDirError(f"unexpected tensors in {model_dir!r}: {unexpected[:8]}")
    return model.eval()


def _map_name(key: str) -> tuple[str, int]:
    for pattern, repl, shard in _FUSED:
        if pattern.match(key):
            return pattern.sub(repl, key), shard
    return key, 0


def _copy_in(param: torch.nn.Parameter, tensor: torch.Tensor, cfg: ModelConfig,
             name: str, shard: int) -> None:
    with torch.no_grad():
        if "qkv_proj" in name or "gate_up_proj" in name:
            sizes = _shard_sizes(cfg, name)
            start = sum(sizes[:shard])
            dst = param.narrow(0, start, sizes[shard])
        else:
            dst = param
        if dst.shape != tensor.shape:
            raise ModelDirError(
                f"tensor {name} (shard {shard}) has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(dst.shape)}")
        dst.copy_(tensor)
