"""The FP8 KV cache (`--kv-cache-dtype fp8`, vLLM's flag): float8 e4m3 values with one
scale per tensor (per layer, one for K and one for V).

The cache write stores `x / scale` clamped to e4m3's range (+-448); attention reads
`stored * scale` back in the compute dtype. Scales come from the checkpoint where it
has them (vLLM's names: `model.layers.N.self_attn.k_scale` / `v_scale`, or one
`kv_scale` for both), else 1.0; with `--calculate-kv-scales` from the first real
forward pass (engine.kv_scales, which also keeps them where the KV moves). The KV layout carries the dtype (`float8_e4m3fn`,
kvtransfer.layout), so the hand-off, the tiers and peer fetch move one byte a value
and a peer with another KV dtype is refused at the handshake.
"""

from __future__ import annotations

import glob
import os
import re

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
# vLLM's checkpoint names of the KV scales (one scalar each).
_SCALE_KEY = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|v_scale|kv_scale)$")


def is_kv_scale_key(key: str) -> bool:
    """A checkpoint tensor that is a KV cache scale (not a model parameter)."""
    return _SCALE_KEY.match(key) is not None


# A scale: a Python float, or a float32 device scalar (the engine's own, which CUDA graphs
# read through its address).
Scale = float | torch.Tensor


def _is_one(scale: Scale) -> bool:
    return not isinstance(scale, torch.Tensor) and scale == 1.0


def quantize(x: torch.Tensor, scale: Scale) -> torch.Tensor:
    """x / scale in float8 e4m3, clamped to +-448 (what the cache stores)."""
    y = x.float() if _is_one(scale) else x.float() / scale
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: Scale, dtype: torch.dtype) -> torch.Tensor:
    """Stored values back in the compute dtype: x * scale."""
    y = x.float() if _is_one(scale) else x.float() * scale
    return y.to(dtype)


def load_kv_scales(model_dir: str, num_layers: int) -> list[tuple[float, float]]:
    """(k_scale, v_scale) per layer from the checkpoint's *.safetensors, 1.0 where it
    has none (a `kv_scale` serves both)."""
    from safetensors import safe_open

    scales = [[1.0, 1.0] for _ in range(num_layers)]
    # (no files: dummy weights, scales 1.0)
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                m = _SCALE_KEY.match(key)
                if m is None or int(m.group(1)) >= num_layers:
                    continue
                value = float(f.get_tensor(key).float().reshape(-1)[0])
                if value <= 0 or value != value:
                    raise ValueError(f"{key} in {model_dir!r} is {value}: a KV scale must be "
                                     "positive")
                layer = scales[int(m.group(1))]
                if m.group(2) in ("k_scale", "kv_scale"):
                    layer[0] = value
                if m.group(2) in ("v_scale", "kv_scale"):
                    layer[1] = value
    return [(k, v) for k, v in scales]
