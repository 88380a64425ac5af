# @triton.jit kernels take untyped parameters (Triton reads annotations itself).
# mypy: allow-untyped-defs
"""Split-K paged decode (flash-decoding) over the cache layout of
engine.attention.triton_attn: for steps whose sequences have at most one query each, a
split kernel spreads every (sequence, KV head)'s key tiles over `num_splits` programs
and writes float32 partials with their log-sum-exps; a reduce kernel merges them. The
tile step itself (`_attend_tile`) is the unified kernel's. Grids are sized from host
ints only, so every launch is capturable in a CUDA graph."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.attention.triton_attn import (
    LOG2E,
    _attend_tile,
    _cache_strides,
    _dot_args,
    _fp8_args,
    _group,
    _new_output,
    _scale_args,
    _scales,
    _tile_n,
)
from engine.kv_quant import Scale

MAX_SPLITS = 16
CPU_SPLITS = 4  # the interpreter: enough splits to exercise the reduction, few programs


@dataclass(frozen=True, slots=True)
class DecodeTile:
    """A launch configuration of split-K decode (engine.attention.tuning picks one per
    batch shape on CUDA). Every configuration computes the same attention, up to
    rounding: keys per
    tile, warps and pipeline stages per program, and the split rule's target waves of
    programs over the SMs (`num_decode_splits`). None: the untuned tile (`_tile_n`)."""

    tile_n: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    waves: int = 2


# See triton_attn._PER_STEP (its grid carries the count). The split count is a plain
# argument too: one compiled variant serves every batch shape (start-up tuning times
# several).
@triton.jit(do_not_specialize=["bt_st", "num_splits"])
def _decode_split_kernel(part_ptr, lse_ptr, q_ptr, cache_ptr, bt_ptr, seq_lens_ptr,
                         qsl_ptr, num_heads, scale_log2, window, k_scale_ptr, v_scale_ptr,
                         q_st, q_sh, q_sd, c_sb, c_skv, c_so, c_sh, c_sd, bt_st,
                         num_splits: tl.int32,
                         GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                         TILE_N: tl.constexpr,
                         USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         DOT_F32: tl.constexpr, FP8: tl.constexpr,
                         FP8_BITS: tl.constexpr):
    """Grid (num_seqs, kv_heads, num_splits): the one query of a decode sequence, the
    GROUP heads of one KV head, over one split's share of the key tiles. Writes that
    split's normalized output and base-2 log-sum-exp (-inf for an empty split)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    head = kvh * GROUP + rows
    row_ok = rows < GROUP
    tok = tl.load(qsl_ptr + seq)
    k_scale, v_scale = _scales(k_scale_ptr, v_scale_ptr, FP8)
    # Only a real query row is read (a padding or query-less sequence reads none).
    q_rows = tl.where(seq_len > 0, tl.minimum(tl.load(qsl_ptr + seq + 1) - tok, 1), 0)
    q = tl.load(q_ptr + tok.to(tl.int64) * q_st + head[:, None] * q_sh + d[None, :] * q_sd,
                mask=(rows < q_rows * GROUP)[:, None], other=0.0)
    pos = tl.zeros([BLOCK_M], tl.int32) + seq_len - 1
    # Splits share the tiles in range; seq_len comes from the device, so the split of
    # work adapts per step while the grid stays fixed.
    # | skipped (outside window) | split 0 | split 1 | ... | (empty splits) |
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    first = lo // TILE_N
    per_split = tl.cdiv(tl.cdiv(seq_len, TILE_N) - first, num_splits)
    begin = (first + split * per_split) * TILE_N
    end = tl.minimum(begin + per_split * TILE_N, seq_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(begin, end, TILE_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, start, pos, seq, end, window,
                                     cache_ptr, bt_ptr, bt_st, kvh,
                                     c_sb, c_skv, c_so, c_sh, c_sd, scale_log2,
                                     k_scale, v_scale, BLOCK_SIZE, HEAD_DIM, TILE_N,
                                     USE_WINDOW, DOT_PRECISION, DOT_F32, FP8, FP8_BITS,
                                     True)
    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    at = (seq * num_heads + head) * num_splits + split  # scratch [B, H, num_splits(, D)]
    tl.store(lse_ptr + at, lse, mask=row_ok)
    tl.store(part_ptr + at[:, None] * HEAD_DIM + d[None, :], out, mask=row_ok[:, None])


@triton.jit
def _decode_reduce_kernel(out_ptr, part_ptr, lse_ptr, qsl_ptr, num_heads,
                          o_st, o_sh, o_sd,
                          HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Grid (num_seqs, heads): merges the splits' partial outputs by their lse."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(qsl_ptr + seq)
    if tl.load(qsl_ptr + seq + 1) == tok:
        return  # a sequence without a query row
    splits = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    at = (seq * num_heads + head) * NUM_SPLITS + splits
    lse = tl.load(lse_ptr + at)
    m = tl.max(lse, 0)
    # Every split empty (a padding sequence): weights all 0, output 0.
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    part = tl.load(part_ptr + at[:, None] * HEAD_DIM + d[None, :])
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + tok.to(tl.int64) * o_st + head * o_sh + d * o_sd,
             out.to(out_ptr.dtype.element_ty))

@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_decode_splits(num_seqs: int, kv_heads: int, device: torch.device,
                      waves: int = 2) -> int:
    """Splits per (sequence, KV head) for split-K decode: enough programs for ~`waves`
    waves over the GPU's SMs, a power of two, at most MAX_SPLITS. It depends on the batch
    shape only (never on sequence lengths), so a captured graph stays valid."""
    if device.type != "cuda":
        return CPU_SPLITS
    index = device.index if device.index is not None else torch.cuda.current_device()
    want = triton.cdiv(waves * _sm_count(index), max(1, num_seqs * kv_heads))
    return min(MAX_SPLITS, triton.next_power_of_2(want))


def decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                     query_start_loc_cpu: list[int], scale: float,
                     sliding_window: int | None = None,
                     num_splits: int | None = None, k_scale: Scale = 1.0,
                     v_scale: Scale = 1.0, tile: DecodeTile | None = None) -> torch.Tensor:
    """Split-K paged decode (every sequence has at most one query): a split kernel
    writes float32 partials and log-sum-exps, a reduce kernel merges them. `tile`
    configures the split kernel's launch (default: DecodeTile())."""
    group = _group(q, kv_layer)
    num_tokens, heads, head_dim = q.shape
    num_seqs, kv_heads = query_start_loc.shape[0] - 1, kv_layer.shape[3]
    out = _new_output(q, query_start_loc_cpu)
    if num_tokens == 0 or num_seqs == 0:
        return out
    tile = tile or DecodeTile()
    splits = num_splits or num_decode_splits(num_seqs, kv_heads, q.device, tile.waves)
    if splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {splits}")
    part = torch.empty((num_seqs, heads, splits, head_dim), dtype=torch.float32,
                       device=q.device)
    lse = torch.empty((num_seqs, heads, splits), dtype=torch.float32, device=q.device)
    cache, fp8 = _fp8_args(kv_layer)
    _decode_split_kernel[(num_seqs, kv_heads, splits)](
        part, lse, q, cache, block_tables, seq_lens, query_start_loc, heads,
        scale * LOG2E, sliding_window or 0, *_scale_args(k_scale, v_scale, kv_layer),
        *q.stride(), *_cache_strides(kv_layer),
        block_tables.stride(0), splits, GROUP=group, BLOCK_SIZE=kv_layer.shape[2],
        HEAD_DIM=head_dim, BLOCK_M=max(16, triton.next_power_of_2(group)),
        TILE_N=tile.tile_n or _tile_n(q), USE_WINDOW=sliding_window is not None,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **_dot_args(q), **fp8)
    _decode_reduce_kernel[(num_seqs, heads)](
        out, part, lse, query_start_loc, heads, *out.stride(),
        HEAD_DIM=head_dim, NUM_SPLITS=splits)
    return out
