# @triton.jit kernels take untyped parameters (Triton reads annotations itself).
# mypy: allow-untyped-defs
"""Triton kernels for MLA over the paged latent cache: the latent write, the absorbed
decode and the absorbed attention of causal query runs (engine.attention.mla draws the
cache and the algebra).

In the latent space every head of a sequence reads the same cache entries, so a
program takes a tile of heads of one sequence and reads each entry tile once for all
of them (MQA-style). Decode: one program per (sequence, tile of BLOCK_H heads, split of
its context):

    # program (seq, head tile, split): keys [split * chunk, (split + 1) * chunk)
    #   s  = q_lat @ c^T + q_pe @ k_pe^T   [BLOCK_H, BLOCK_N]   (online softmax)
    #   acc += p @ c                        [BLOCK_H, rank]

Splits (flash-decoding) give a batch-1 decode enough programs; a second kernel merges
them by their log-sum-exp.

Mixed steps of the CUDA graphs (engine.mixed_graphs): one program per (query tile of
one sequence, head tile), whose rows are BLOCK_Q tokens x BLOCK_H heads; it walks the
sequence's entry tiles once for all its rows, causal by position:

    # rows: | tok0 h0 .. tok0 hH-1 | tok1 h0 .. | ... |   (BLOCK_Q x BLOCK_H = BLOCK_M)
    # keys: 0 .. ctx + last token of the tile; row (t, h) sees j <= ctx + t

Its grid, (T // BLOCK_Q + B, head tiles), follows from the bucket alone, as the unified
MHA kernel's does (engine.attention.triton_attn): a program finds its sequence in
query_start_loc, surplus programs exit, padding sequences (seq_len 0) write zeros.

Why only those steps: per head, a sequence with Q new queries over C keys costs,
absorbed, Q * (nope + v) * rank multiply-adds (W_UK into its queries, W_UV out of them)
plus Q * C * (2 * rank + rope) over the pairs; decompressed, C * (nope + v) * rank
(kv_b_proj over its context) plus Q * C * (nope + rope + v). For DeepSeek-V3's shape
(rank 512, rope 64, nope = v = 128) that is 131,072 per query or per key, and 1,088
against 320 per pair. A short run over a long cached prefix (the chunks and decode rows
of a mixed step) pays per query instead of per context entry and favours the absorbed
form; a run as long as its context (a fresh prompt), or longer than about
(nope + v) * rank / (2 * rank - nope - v) ~ 170 queries over a long prefix, does fewer
FLOPs decompressed, where SDPA's tensor-core tiles take K and V. So a step takes a
bucket only where the absorbed form costs no more, summed over its sequences
(`engine.attention.mla.absorbed_is_cheaper`): decode rows and chunks over a long prefix
do, a step of fresh prompts does not and runs eagerly, decompressed, as do the steps
over the largest bucket.

Grids come from host ints only, so the decode and mixed kernels are capturable in CUDA
graphs. W_UK / W_UV stay batched matmuls around the kernels. Tiles are untuned
(chosen without a GPU to measure on).
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
from engine.attention.triton_attn import _query_block

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
def _latent_tile(cache_ptr, bt_ptr, seq, bt_st, start, hi, c_sb, c_so, RANK: tl.constexpr,
                 ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_P: tl.constexpr, TILE_N: tl.constexpr):
    """Cache entries start .. start + TILE_N - 1 of sequence `seq`: their positions,
    which of them are < hi, their latents [TILE_N, BLOCK_R] and rope keys [TILE_N,
    BLOCK_P] in the cache's dtype (zeros past hi, RANK and ROPE)."""
    kpos = start + tl.arange(0, TILE_N)
    kv_ok = kpos < hi
    blk = tl.load(bt_ptr + seq * bt_st + kpos // BLOCK_SIZE, mask=kv_ok, other=0)
    base = cache_ptr + blk.to(tl.int64) * c_sb + (kpos % BLOCK_SIZE) * c_so
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    c = tl.load(base[:, None] + r[None, :], mask=kv_ok[:, None] & (r < RANK)[None, :],
                other=0.0)
    kp = tl.load(base[:, None] + RANK + p[None, :], mask=kv_ok[:, None] & (p < ROPE)[None, :],
                 other=0.0)
    return kpos, kv_ok, c, kp


# (per-step widths and strides: one compiled variant for every step, see
# triton_attn._PER_STEP)
@triton.jit(do_not_specialize=["bt_st", "l_st"])
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
        _, pmask, c, kp = _latent_tile(cache_ptr, bt_ptr, s, bt_st, start, hi, c_sb, c_so,
                                       RANK, ROPE, BLOCK_SIZE, BLOCK_R, BLOCK_P, BLOCK_N)
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


@triton.jit(do_not_specialize=["num_seqs", "bt_st"])
def _mla_absorbed_kernel(out_ptr, ql_ptr, qp_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
                         num_seqs: tl.int32, num_heads, scale_log2, ql_st, ql_sh, qp_st,
                         qp_sh, o_st, o_sh, c_sb, c_so, bt_st,
                         RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr,
                         TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                         DOT_F32: tl.constexpr):
    """Grid (num_tokens // BLOCK_Q + num_seqs, head tiles): one program per query tile
    of BLOCK_Q tokens of one sequence and BLOCK_H heads; surplus programs exit."""
    q_block = tl.program_id(0)
    hb = tl.program_id(1)
    seq, q_start, q_len, local, seq_len = _query_block(qsl_ptr, seq_lens_ptr, q_block,
                                                       num_seqs, BLOCK_Q)
    if local * BLOCK_Q >= q_len:
        return
    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    q_idx = local * BLOCK_Q + rows // BLOCK_H  # the row's query within its sequence
    head = hb * BLOCK_H + rows % BLOCK_H
    row_ok = (q_idx < q_len) & (head < num_heads)
    tok = (q_start + q_idx).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    r_ok = (r < RANK)[None, :]
    p_ok = (p < ROPE)[None, :]
    ql = tl.load(ql_ptr + tok[:, None] * ql_st + head[:, None] * ql_sh + r[None, :],
                 mask=row_ok[:, None] & r_ok, other=0.0)
    qp = tl.load(qp_ptr + tok[:, None] * qp_st + head[:, None] * qp_sh + p[None, :],
                 mask=row_ok[:, None] & p_ok, other=0.0)
    if DOT_F32:
        # Triton's interpreter multiplies bfloat16 operands as their raw bits: the CPU
        # runs the dots in float32 (p is still rounded to the cache's dtype below).
        ql = ql.to(tl.float32)
        qp = qp.to(tl.float32)
    # | cached context (ctx) | new tokens (q_len) |: query q_idx sits at ctx + q_idx.
    # Keys the tile can see end at its last valid query (a padding sequence, seq_len 0,
    # sees none and writes zeros).
    ctx = seq_len - q_len
    pos = ctx + q_idx
    hi = ctx + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len)
    m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_R], tl.float32)
    for start in range(0, hi, TILE_N):
        kpos, kv_ok, c, kp = _latent_tile(cache_ptr, bt_ptr, seq, bt_st, start, hi, c_sb,
                                          c_so, RANK, ROPE, BLOCK_SIZE, BLOCK_R, BLOCK_P,
                                          TILE_N)
        if DOT_F32:
            kp = kp.to(tl.float32)
            sc = tl.dot(ql, tl.trans(c.to(tl.float32)), input_precision=DOT_PRECISION)
        else:
            sc = tl.dot(ql, tl.trans(c), input_precision=DOT_PRECISION)
        sc += tl.dot(qp, tl.trans(kp), input_precision=DOT_PRECISION)
        visible = kv_ok[None, :] & (kpos[None, :] <= pos[:, None])
        sc = tl.where(visible, sc * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        # A row with nothing visible yet keeps m = -inf: shift by 0 there (no NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(sc - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        pr = pr.to(c.dtype)
        if DOT_F32:
            pv = tl.dot(pr.to(tl.float32), c.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            pv = tl.dot(pr, c, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok[:, None] * o_st + head[:, None] * o_sh + r[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & r_ok)


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


def _check_query(q_latent: torch.Tensor, q_pe: torch.Tensor,
                 kv_layer: torch.Tensor) -> torch.Tensor:
    """The layer's entries [num_blocks, block_size, rank + rope], once q fits them."""
    entries = latent_entries(kv_layer)
    rank, rope = q_latent.shape[2], q_pe.shape[2]
    if entries.shape[-1] != rank + rope:
        raise ValueError(f"cache entries hold {entries.shape[-1]} values, q gives "
                         f"{rank} + {rope}")
    if q_latent.dtype != entries.dtype or q_pe.dtype != entries.dtype:
        raise ValueError(f"q is {q_latent.dtype} but the latent cache is {entries.dtype}")
    return entries


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, num_seqs: int, scale: float,
               splits: int | None = None) -> torch.Tensor:
    """Attention of each sequence's one query row over its latent context.
    q_latent [T, H, rank] (q_nope through W_UK), q_pe [T, H, rope]. Returns the
    attention-weighted latent [T, H, rank] (rows of padding sequences are zeros)."""
    entries = _check_query(q_latent, q_pe, kv_layer)
    t, heads, rank = q_latent.shape
    rope = q_pe.shape[2]
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


def mla_absorbed(q_latent: torch.Tensor, q_pe: torch.Tensor, kv_layer: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed attention of every query row: each sequence's rows are a causal run
    ending at its last context position (a decode row, a prefill chunk over a cached
    prefix), in one launch whose grid depends on the shapes alone. q_latent [T, H, rank]
    (q_nope through W_UK), q_pe [T, H, rope]. Returns the attention-weighted latent [T,
    H, rank]: zeros for padding sequences and for rows past query_start_loc's end."""
    entries = _check_query(q_latent, q_pe, kv_layer)
    t, heads, rank = q_latent.shape
    num_seqs = query_start_loc.shape[0] - 1
    out = torch.zeros_like(q_latent)
    if t == 0 or num_seqs == 0:
        return out
    # Rows per program: 16 (tl.dot's minimum), heads first (they share every entry
    # read); with fewer heads than that, several tokens fill the rows. Untuned: with 16
    # heads or more a program holds one token, so a chunk of Q tokens reads its
    # sequence's latents Q times per head tile (more tokens per program would read them
    # less often, at the cost of registers for the [rows, rank] accumulator).
    block_h = min(16, triton.next_power_of_2(heads))
    block_q = 16 // block_h
    f32 = q_latent.dtype == torch.float32
    _mla_absorbed_kernel[(t // block_q + num_seqs, triton.cdiv(heads, block_h))](
        out, q_latent, q_pe, entries, block_tables, seq_lens, query_start_loc, num_seqs,
        heads, scale * LOG2E, q_latent.stride(0), q_latent.stride(1), q_pe.stride(0),
        q_pe.stride(1), out.stride(0), out.stride(1), entries.stride(0), entries.stride(1),
        block_tables.stride(0), RANK=rank, ROPE=q_pe.shape[2],
        BLOCK_SIZE=entries.shape[1], BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_P=max(16, triton.next_power_of_2(q_pe.shape[2])), BLOCK_H=block_h,
        BLOCK_Q=block_q, TILE_N=16, DOT_PRECISION="ieee" if f32 else "tf32",
        DOT_F32=not q_latent.is_cuda and q_latent.dtype == torch.bfloat16)
    return out


class TritonMLABackend:
    """The latent write and the absorbed paged attention in Triton for decode-only steps
    and the steps of the mixed CUDA graphs (`meta.graph_bucket`); the larger steps, run
    eagerly, decompress K/V (engine.attention.mla.prefill_decompressed)."""

    name = "triton"

    def __init__(self, splits: int | None = None) -> None:
        self.splits = splits

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                k_pe: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                scale: float, w_kv: torch.Tensor) -> torch.Tensor:
        write_latent(latent.contiguous(), k_pe.contiguous(), kv_layer, meta.slot_mapping)
        absorbed = meta.graph_bucket
        if not absorbed and not meta.is_decode_only:
            return prefill_decompressed(q_nope, q_pe, kv_layer, meta, scale, w_kv)
        heads = q_nope.shape[1]
        w_uk, w_uv = split_kv_weight(w_kv, heads, w_kv.shape[0] // heads - q_nope.shape[2])
        q_lat = absorb_query(q_nope, w_uk)
        if absorbed:  # a bucket of the mixed graphs (a bucket of 1 token included)
            o_lat = mla_absorbed(q_lat, q_pe, kv_layer, meta.block_tables, meta.seq_lens,
                                 meta.query_start_loc, scale)
        else:
            o_lat = mla_decode(q_lat, q_pe, kv_layer, meta.block_tables, meta.seq_lens,
                               meta.query_start_loc, meta.num_seqs, scale, self.splits)
        return expand_output(o_lat, w_uv)
