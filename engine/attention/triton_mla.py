# @triton.jit kernels take untyped parameters (Triton reads annotations itself).
# mypy: allow-untyped-defs
"""Triton kernels for MLA over the paged latent cache: the latent write and the
absorbed decode (engine.attention.mla draws the cache and the algebra).

Decode runs in the latent space, so every head of a sequence reads the same cache
entries: one program takes a tile of BLOCK_H heads of one sequence and one split of its
context, and reads each entry tile once for all of them (MQA-style):

    # program (seq, head tile, split): keys [split * chunk, (split + 1) * chunk)
    #   s  = q_lat @ c^T + q_pe @ k_pe^T   [BLOCK_H, BLOCK_N]   (online softmax)
    #   acc += p @ c                        [BLOCK_H, rank]

Splits (flash-decoding) give a batch-1 decode enough programs; a second kernel merges
them by their log-sum-exp. Grids come from host ints only, so a decode step is
capturable in a CUDA graph. W_UK / W_UV stay batched matmuls around the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.base import AttentionMetadata
from engine.attention.mla import (
    absorb_query,
    expand_output,
    latent_entries,
    prefill_decompressed,
    split_kv_weight,
)

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
CPU_SPLITS = 2  # the interpreter: enough to exercise the merge, few programs


@triton.jit
def _write_latent_kernel(lat_ptr, pe_ptr, cache_ptr, slot_ptr, lat_st, pe_st, c_sb, c_so,
                         RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """One program per new token: its latent then its rope key into its slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return  # a padding token
    dst = cache_ptr + (slot // BLOCK_SIZE) * c_sb + (slot % BLOCK_SIZE) * c_so
    r = tl.arange(0, BLOCK_R)
    tl.store(dst + r, tl.load(lat_ptr + t * lat_st + r, mask=r < RANK).to(
        cache_ptr.dtype.element_ty), mask=r < RANK)
    p = tl.arange(0, BLOCK_P)
    tl.store(dst + RANK + p, tl.load(pe_ptr + t * pe_st + p, mask=p < ROPE).to(
        cache_ptr.dtype.element_ty), mask=p < ROPE)


@triton.jit
def _mla_decode_kernel(part_ptr, lse_ptr, ql_ptr, qp_ptr, cache_ptr, bt_ptr, seq_lens_ptr,
                       qsl_ptr, num_heads, scale_log2, ql_st, ql_sh, qp_st, qp_sh,
                       c_sb, c_so, bt_st, p_st, p_ss, p_sh, l_st, l_ss,
                       RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    s = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + s)
    row = tl.load(qsl_ptr + s).to(tl.int64)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < num_heads
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    ql = tl.load(ql_ptr + row * ql_st + h[:, None] * ql_sh + r[None, :],
                 mask=hmask[:, None] & (r < RANK)[None, :], other=0.0)
    qp = tl.load(qp_ptr + row * qp_st + h[:, None] * qp_sh + p[None, :],
                 mask=hmask[:, None] & (p < ROPE)[None, :], other=0.0)
    if DOT_F32:
        ql = ql.to(tl.float32)
        qp = qp.to(tl.float32)
    # This split's keys: whole BLOCK_N tiles, so splits never share a tile.
    tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(tiles, NUM_SPLITS)
    lo = split * per_split * BLOCK_N
    hi = tl.minimum(seq_len, (split + 1) * per_split * BLOCK_N)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pmask = pos < hi
        blk = tl.load(bt_ptr + s * bt_st + pos // BLOCK_SIZE, mask=pmask, other=0).to(tl.int64)
        base = cache_ptr + blk * c_sb + (pos % BLOCK_SIZE) * c_so
        c = tl.load(base[:, None] + r[None, :], mask=pmask[:, None] & (r < RANK)[None, :],
                    other=0.0)
        kp = tl.load(base[:, None] + RANK + p[None, :],
                     mask=pmask[:, None] & (p < ROPE)[None, :], other=0.0)
        if DOT_F32:
            c = c.to(tl.float32)
            kp = kp.to(tl.float32)
        sc = tl.dot(ql, tl.trans(c), input_precision=DOT_PRECISION)
        sc += tl.dot(qp, tl.trans(kp), input_precision=DOT_PRECISION)
        sc = tl.where(pmask[None, :], sc * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(part_ptr + row * p_st + split * p_ss + h[:, None] * p_sh + r[None, :], out,
             mask=hmask[:, None] & (r < RANK)[None, :])
    tl.store(lse_ptr + row * l_st + split * l_ss + h, lse, mask=hmask)


@triton.jit
def _mla_merge_kernel(out_ptr, part_ptr, lse_ptr, qsl_ptr, num_heads, o_st, o_sh,
                      p_st, p_ss, p_sh, l_st, l_ss, RANK: tl.constexpr,
                      BLOCK_R: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """One program per (sequence, head): the splits weighted by exp2(lse - max lse)."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(qsl_ptr + s).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    sp = tl.arange(0, NUM_SPLITS)
    lse = tl.load(lse_ptr + row * l_st + sp * l_ss + h)
    m = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - tl.where(m > float("-inf"), m, 0.0)), 0.0)
    parts = tl.load(part_ptr + row * p_st + sp[:, None] * p_ss + h * p_sh + r[None, :],
                    mask=(r < RANK)[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * o_st + h * o_sh + r, out.to(out_ptr.dtype.element_ty),
             mask=r < RANK)


def write_latent(latent: torch.Tensor, k_pe: torch.Tensor, kv_layer: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Scatters latent [T, rank] and k_pe [T, rope] into their slots in one launch."""
    entries = latent_entries(kv_layer)
    t, rank = latent.shape
    rope = k_pe.shape[1]
    if t == 0:
        return
    if latent.stride(-1) != 1 or k_pe.stride(-1) != 1 or entries.stride(-1) != 1:
        raise ValueError("latent, k_pe and the cache need a contiguous last dimension")
    _write_latent_kernel[(t,)](
        latent, k_pe, entries, slot_mapping, latent.stride(0), k_pe.stride(0),
        entries.stride(0), entries.stride(1), RANK=rank, ROPE=rope,
        BLOCK_SIZE=entries.shape[1], BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_P=triton.next_power_of_2(rope))


def num_splits(num_seqs: int, head_tiles: int, device: torch.device) -> int:
    """Splits per sequence: enough programs to fill the GPU's SMs (a power of two)."""
    if device.type != "cuda":
        return CPU_SPLITS
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    n = 1
    while n < MAX_SPLITS and num_seqs * head_tiles * n < sms:
        n *= 2
    return n


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, num_seqs: int, scale: float,
               splits: int | None = None) -> torch.Tensor:
    """Attention of each sequence's one query row over its latent context.
    q_latent [T, H, rank] (q_nope through W_UK), q_pe [T, H, rope]. Returns the
    attention-weighted latent [T, H, rank] (rows of padding sequences are zeros)."""
    entries = latent_entries(kv_layer)
    t, heads, rank = q_latent.shape
    rope = q_pe.shape[2]
    if entries.shape[-1] != rank + rope:
        raise ValueError(f"cache entries hold {entries.shape[-1]} values, q gives "
                         f"{rank} + {rope}")
    if q_latent.dtype != entries.dtype or q_pe.dtype != entries.dtype:
        raise ValueError(f"q is {q_latent.dtype} but the latent cache is {entries.dtype}")
    out = torch.zeros_like(q_latent)
    if num_seqs == 0:
        return out
    block_h = 16  # tl.dot's minimum rows; more heads take more tiles
    head_tiles = triton.cdiv(heads, block_h)
    n_splits = splits or num_splits(num_seqs, head_tiles, q_latent.device)
    part = torch.empty((t, n_splits, heads, rank), dtype=torch.float32, device=out.device)
    lse = torch.empty((t, n_splits, heads), dtype=torch.float32, device=out.device)
    f32 = q_latent.dtype == torch.float32
    block_r = max(16, triton.next_power_of_2(rank))
    _mla_decode_kernel[(num_seqs, head_tiles, n_splits)](
        part, lse, q_latent, q_pe, entries, block_tables, seq_lens, query_start_loc, heads,
        scale * LOG2E, q_latent.stride(0), q_latent.stride(1), q_pe.stride(0),
        q_pe.stride(1), entries.stride(0), entries.stride(1), block_tables.stride(0),
        *part.stride()[:3], *lse.stride()[:2],
        RANK=rank, ROPE=rope, BLOCK_SIZE=entries.shape[1], BLOCK_R=block_r,
        BLOCK_P=max(16, triton.next_power_of_2(rope)), BLOCK_H=block_h, BLOCK_N=16,
        NUM_SPLITS=n_splits, DOT_PRECISION="ieee" if f32 else "tf32",
        DOT_F32=not q_latent.is_cuda and q_latent.dtype == torch.bfloat16)
    _mla_merge_kernel[(num_seqs, heads)](
        out, part, lse, query_start_loc, heads, out.stride(0), out.stride(1),
        *part.stride()[:3], *lse.stride()[:2], RANK=rank, BLOCK_R=block_r,
        NUM_SPLITS=n_splits)
    return out


class TritonMLABackend:
    """The latent write and the absorbed paged decode in Triton; steps with prefill
    decompress K/V (engine.attention.mla.prefill_decompressed)."""

    name = "triton"

    def __init__(self, splits: int | None = None) -> None:
        self.splits = splits

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                k_pe: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                scale: float, w_kv: torch.Tensor) -> torch.Tensor:
        write_latent(latent.contiguous(), k_pe.contiguous(), kv_layer, meta.slot_mapping)
        if not meta.is_decode_only:
            return prefill_decompressed(q_nope, q_pe, kv_layer, meta, scale, w_kv)
        heads = q_nope.shape[1]
        w_uk, w_uv = split_kv_weight(w_kv, heads, w_kv.shape[0] // heads - q_nope.shape[2])
        q_lat = absorb_query(q_nope, w_uk)
        o_lat = mla_decode(q_lat, q_pe, kv_layer, meta.block_tables, meta.seq_lens,
                           meta.query_start_loc, meta.num_seqs, scale, self.splits)
        return expand_output(o_lat, w_uv)
