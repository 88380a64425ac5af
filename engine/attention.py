"""Attention over the paged, block-major KV cache.

The cache is one tensor `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`;
a layer sees strided views `cache[:, layer, 0]` (K) and `cache[:, layer, 1]` (V) of
shape `[num_blocks, block_size, kv_heads, head_dim]`. New K/V are scattered into their
slots, then each sequence's context is gathered through its block table and torch's
SDPA runs on it. Decoding sequences (one query token each) share one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


@dataclass(slots=True)
class PrefillSeq:
    q_start: int  # offset of this sequence's tokens in the flat batch
    q_len: int
    ctx_len: int  # tokens with KV after this step (cached + new)
    block_table: torch.Tensor  # [num_blocks_of_seq] int64


@dataclass(slots=True)
class AttentionMetadata:
    """How the flat token batch maps onto sequences and cache slots for one step."""

    slot_blocks: torch.Tensor  # [T] block id of each new token
    slot_offsets: torch.Tensor  # [T] offset within its block
    prefills: list[PrefillSeq]
    decode_idx: torch.Tensor | None  # [B] flat positions of decode tokens
    decode_block_tables: torch.Tensor | None  # [B, max_blocks], padded with 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool, True = keep
    sliding_window: int | None = None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          is_causal: bool) -> torch.Tensor:
    """q: [B, H, Tq, D]; k, v: [B, KVH, Tk, D] -> [B, H, Tq, D]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not _HAS_GQA:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    kw = {"enable_gqa": True} if groups > 1 and _HAS_GQA else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **kw)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens; kv_layer: cache[:, layer].

    Writes k, v into the cache and returns the attention output [T, H, D].
    """
    k_cache, v_cache = kv_layer[:, 0], kv_layer[:, 1]
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v
    out = torch.empty_like(q)
    for seq in meta.prefills:
        sl = slice(seq.q_start, seq.q_start + seq.q_len)
        qs = q[sl].transpose(0, 1).unsqueeze(0)
        mask = None
        if seq.ctx_len == seq.q_len and meta.sliding_window is None:
            ks, vs = k[sl], v[sl]  # nothing cached before: use the fresh K/V directly
        else:
            ks = k_cache[seq.block_table].flatten(0, 1)[:seq.ctx_len]
            vs = v_cache[seq.block_table].flatten(0, 1)[:seq.ctx_len]
            mask = _causal_mask(seq.q_len, seq.ctx_len, meta.sliding_window, q.device)
        o = _sdpa(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                  mask, is_causal=mask is None)
        out[sl] = o.squeeze(0).transpose(0, 1)
    if meta.decode_idx is not None:
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        bt = meta.decode_block_tables
        ks = k_cache[bt].flatten(1, 2).transpose(1, 2)  # [B, KVH, S, D]
        vs = v_cache[bt].flatten(1, 2).transpose(1, 2)
        qs = q[meta.decode_idx].unsqueeze(2)  # [B, H, 1, D]
        o = _sdpa(qs, ks, vs, meta.decode_mask, is_causal=False)
        out[meta.decode_idx] = o.squeeze(2)
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


def decode_mask(ctx_lens: torch.Tensor, max_len: int, window: int | None) -> torch.Tensor:
    """[B, 1, 1, max_len] bool: key j is visible to a decode token at ctx_len - 1."""
    kpos = torch.arange(max_len, device=ctx_lens.device).unsqueeze(0)
    mask = kpos < ctx_lens.unsqueeze(1)
    if window is not None:
        mask &= kpos > (ctx_lens.unsqueeze(1) - 1 - window)
    return mask[:, None, None, :]
