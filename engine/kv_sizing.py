"""The KV cache tensor's shape, dtype and size in blocks, for the model runner that
allocates it and the worker that announces it before the engine starts."""

from __future__ import annotations

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_quant import FP8_DTYPE
from engine.models.loader import TORCH_DTYPES

CPU_KV_BYTES = 512 * 1024 * 1024  # the CPU pool's default size


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The block-major cache (`kvtransfer.layout` draws it); MLA: one latent part."""
    parts, heads, head_dim = cfg.kv_cache_dims
    return (num_blocks, cfg.num_layers, parts, block_size, heads, head_dim)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    parts, heads, head_dim = cfg.kv_cache_dims
    return cfg.num_layers * parts * block_size * heads * head_dim * dtype.itemsize


def kv_cache_dtype(config: EngineConfig, model_cfg: ModelConfig) -> torch.dtype:
    """The KV cache tensor's dtype: the compute dtype, or float8 e4m3 under
    --kv-cache-dtype fp8 (refused for MLA's latent cache, which has no scales)."""
    if not config.fp8_kv:
        return TORCH_DTYPES[config.dtype or model_cfg.dtype]
    if model_cfg.mla is not None:
        raise ValueError(f"--kv-cache-dtype {config.cache.cache_dtype} is not supported for "
                         "MLA models (DeepSeek's latent cache); use --kv-cache-dtype auto")
    return FP8_DTYPE


def num_kv_blocks(config: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype) -> int | None:
    """The KV pool's size in blocks: `cache.num_blocks`, else what fits the byte budget
    (512 MiB on CPU). None on CUDA without either: sized from free GPU memory."""
    cache = config.cache
    if cache.num_blocks:
        return cache.num_blocks
    budget = cache.kv_cache_memory_bytes
    if budget is None and config.device.startswith("cuda"):
        return None
    return max(1, (budget or CPU_KV_BYTES) // kv_block_bytes(model_cfg, cache.block_size, dtype))
