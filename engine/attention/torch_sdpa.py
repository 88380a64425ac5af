"""The reference backend (and the CPU default): torch's SDPA, one call per sequence.

Per sequence, its blocks are gathered (one `index_select` brings K and V together)
and SDPA runs on exactly its context: no padding, no mask for decode. On CPU this
per-sequence loop measured ~3x faster than one padded, masked batch (SDPA's masked
path dominates). The Triton backend is the CUDA default; this one is what its
kernels are checked against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.kv_quant import FP8_DTYPE, Scale, dequantize, quantize

_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          is_causal: bool, scale: float) -> torch.Tensor:
    """q: [1, H, Tq, D]; k, v: [1, KVH, Tk, D] -> [1, H, Tq, D]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not _HAS_GQA:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    kw = {"enable_gqa": True} if groups > 1 and _HAS_GQA else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                          scale=scale, **kw)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: Scale = 1.0, v_scale: Scale = 1.0) -> None:
    """Scatters the new tokens' K/V into their slots (padding slots, -1, skipped);
    into a float8 cache quantized by the scales."""
    bs = kv_layer.shape[2]
    if kv_layer.dtype == FP8_DTYPE:
        k, v = quantize(k, k_scale), quantize(v, v_scale)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    blocks, offsets = slot_mapping // bs, slot_mapping % bs
    kv_layer[:, 0][blocks, offsets] = k
    kv_layer[:, 1][blocks, offsets] = v


class TorchSDPABackend:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata,
                scale: float, k_scale: Scale = 1.0, v_scale: Scale = 1.0) -> torch.Tensor:
        write_kv(k, v, kv_layer, meta.slot_mapping, k_scale, v_scale)
        fp8 = kv_layer.dtype == FP8_DTYPE
        if fp8:
            # Attention sees what the cache holds, fresh tokens included (as the
            # Triton kernels, which read every key from the cache).
            k = dequantize(quantize(k, k_scale), k_scale, q.dtype)
            v = dequantize(quantize(v, v_scale), v_scale, q.dtype)
        out = torch.zeros_like(q)
        bs = kv_layer.shape[2]
        window = meta.sliding_window
        starts = meta.query_start_loc_cpu
        for i, ctx_len in enumerate(meta.seq_lens_cpu):
            if ctx_len == 0:
                continue  # a padding sequence
            sl = slice(starts[i], starts[i + 1])
            q_len = sl.stop - sl.start
            qs = q[sl].transpose(0, 1).unsqueeze(0)
            if ctx_len == q_len and window is None:
                # Nothing cached before these tokens: use the fresh K/V, plain causal.
                ks = k[sl].transpose(0, 1).unsqueeze(0)
                vs = v[sl].transpose(0, 1).unsqueeze(0)
                o = _sdpa(qs, ks, vs, None, q_len > 1, scale)
            else:
                table = meta.block_tables[i, :-(-ctx_len // bs)]
                # [n, 2, bs, KVH, D] -> [2, KVH, n * bs, D], cut to the context.
                kv = kv_layer.index_select(0, table).permute(1, 3, 0, 2, 4).flatten(2, 3)
                lo = max(0, ctx_len - window) if q_len == 1 and window is not None else 0
                kv = kv[:, :, lo:ctx_len].unsqueeze(1)
                if fp8:
                    kv = torch.stack([dequantize(kv[0], k_scale, q.dtype),
                                      dequantize(kv[1], v_scale, q.dtype)])
                mask = _causal_mask(q_len, ctx_len, window, q.device) if q_len > 1 else None
                o = _sdpa(qs, kv[0], kv[1], mask, False, scale)
            out[sl] = o.squeeze(0).transpose(0, 1)
        return out


def _causal_mask(q_len: int, ctx_len: int, window: int | None,
                 device: torch.device) -> torch.Tensor:
    # Query i sits at absolute position ctx_len - q_len + i and sees keys j <= it
    # (and, with a sliding window, j > it - window).
    qpos = torch.arange(ctx_len - q_len, ctx_len, device=device).unsqueeze(1)
    kpos = torch.arange(ctx_len, device=device).unsqueeze(0)
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    return mask
