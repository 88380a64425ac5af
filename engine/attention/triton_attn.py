# @triton.jit kernels take untyped parameters (Triton reads annotations itself).
# mypy: allow-untyped-defs
"""Triton kernels for the paged KV cache: the KV write, unified (mixed-batch) attention,
and split-K decode (flash-decoding). Launchers are thin and sync-free.

A layer's cache is the strided view `kv_layer = cache[:, layer]`, shape
`[num_blocks, 2, block_size, kv_heads, head_dim]`; every kernel addresses it through its
strides (the block stride spans all layers). Key position `j` of sequence `s` lives in
block `block_tables[s, j // block_size]` at offset `j % block_size`; the kernels look
the block up per key, so a tile of keys need not match the cache's block size.

Query rows: the query heads that share one KV head are packed into the rows of one
program (GQA), so K/V tiles are read once per KV head, not once per query head:

    # rows of a program: | tok0 h0 .. tok0 hG-1 | tok1 h0 .. | ... | padding rows |
    #                      <-------- BLOCK_Q tokens x GROUP heads ------>  (BLOCK_M)

A float8 cache (`--kv-cache-dtype fp8`, engine.kv_quant) is written as K / k_scale and
V / v_scale clamped to +-448 and read back times the scale in q's dtype. On a GPU the
conversions are Triton's own; Triton's interpreter converts to and from float8 wrongly
(a value that rounds up into the next power of two, and subnormals), so off CUDA the
kernels see the cache as bytes and encode / decode e4m3 in integer arithmetic
(engine.attention.triton_fp8), bit-exact with torch's conversion.

No grid depends on device data: they are sized from host ints (token and sequence
counts, heads, static config) and programs find their work in-kernel, so every launch
is capturable in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.attention.triton_fp8 import _kv_load, _kv_store
from engine.kv_quant import FP8_DTYPE, Scale

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
CPU_SPLITS = 4  # the interpreter: enough splits to exercise the reduction, few programs


@dataclass(frozen=True, slots=True)
class DecodeTile:
    """A launch configuration of split-K decode (engine.attention.tuning picks one per
    batch shape on CUDA). Every configuration computes the same attention: keys per
    tile, warps and pipeline stages per program, and the split rule's target waves of
    programs over the SMs (`num_decode_splits`). None: the untuned tile (`_tile_n`)."""

    tile_n: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    waves: int = 2


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, num_kv_heads, k_scale_ptr, v_scale_ptr,
                     k_st, k_sh, k_sd, v_st, v_sh, v_sd,
                     c_sb, c_skv, c_so, c_sh, c_sd,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, FP8: tl.constexpr, FP8_BITS: tl.constexpr):
    """One program per new token: copies its K and V (all KV heads) into its slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return  # a padding token: its slot is -1, nothing to write
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < num_kv_heads
    kx = tl.load(k_ptr + t * k_st + h * k_sh + d * k_sd, mask=mask)
    vx = tl.load(v_ptr + t * v_st + h * v_sh + d * v_sd, mask=mask)
    dst = cache_ptr + blk * c_sb + off * c_so + h * c_sh + d * c_sd
    k_scale, v_scale = _scales(k_scale_ptr, v_scale_ptr, FP8)
    tl.store(dst, _kv_store(kx, k_scale, cache_ptr, FP8, FP8_BITS), mask=mask)
    tl.store(dst + c_skv, _kv_store(vx, v_scale, cache_ptr, FP8, FP8_BITS), mask=mask)


@triton.jit
def _scales(k_scale_ptr, v_scale_ptr, FP8: tl.constexpr):
    """A float8 cache's (k_scale, v_scale), read from the device: a CUDA graph keeps
    the pointers, so scales fixed after capture (--calculate-kv-scales, or a receiver
    adopting a sender's) reach every replay. 1.0 for other caches (nothing read)."""
    if FP8:
        return tl.load(k_scale_ptr), tl.load(v_scale_ptr)
    return 1.0, 1.0


@triton.jit
def _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence that owns global query block `q_block`. Sequence i's query blocks
    start at qsl[i] // BLOCK_Q + i (an upper bound that keeps the ranges disjoint), so
    this is the largest i with that start <= q_block: a binary search over qsl."""
    # (num_seqs is annotated int32 in the kernel: a bare int arg equal to 1 would be
    # specialized into a constant, and `hi` must stay a loop-carried int32.)
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(q, acc, m_i, l_i, start, pos, seq, hi, window, cache_ptr, bt_ptr, bt_st,
                 kvh, c_sb, c_skv, c_so, c_sh, c_sd, scale_log2, k_scale, v_scale,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr,
                 USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 DOT_F32: tl.constexpr, FP8: tl.constexpr, FP8_BITS: tl.constexpr):
    """One online-softmax step over keys start .. start + TILE_N - 1 (those < hi).
    `pos` is each row's absolute query position: a row sees key j iff j <= pos (and,
    with a window, j > pos - window). Softmax runs in base 2 (scale folded in)."""
    kpos = start + tl.arange(0, TILE_N)
    kv_ok = kpos < hi
    d = tl.arange(0, HEAD_DIM)
    blk = tl.load(bt_ptr + seq * bt_st + kpos // BLOCK_SIZE, mask=kv_ok, other=0)
    base = cache_ptr + blk.to(tl.int64) * c_sb + (kpos % BLOCK_SIZE) * c_so + kvh * c_sh
    k = tl.load(base[None, :] + d[:, None] * c_sd, mask=kv_ok[None, :], other=0)
    v = tl.load(base[:, None] + c_skv + d[None, :] * c_sd, mask=kv_ok[:, None], other=0)
    k = _kv_load(k, k_scale, q.dtype, FP8, FP8_BITS)
    v = _kv_load(v, v_scale, q.dtype, FP8, FP8_BITS)
    if DOT_F32:
        # Triton's interpreter multiplies bfloat16 operands as their raw uint16 bits;
        # on the CPU the dots run in float32 (p is still rounded to v's dtype below).
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    visible = kv_ok[None, :] & (kpos[None, :] <= pos[:, None])
    if USE_WINDOW:
        visible = visible & (kpos[None, :] > pos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; shift by 0 there so that
    # exp2(-inf - -inf) never makes a NaN (its p and alpha are then 0).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)
    if DOT_F32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# Integers that change from step to step (the batch's sequence count, its block-table
# width). Triton would otherwise compile a variant per value class (1, a multiple of 16,
# other) of each, ~0.5 s mid-serving (a cold process on an H200 stalled 0.4-0.95 s in
# such steps). Unspecialized, each kernel configuration compiles once.
_PER_STEP = ["num_seqs", "bt_st"]


@triton.jit(do_not_specialize=_PER_STEP)
def _unified_kernel(out_ptr, q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
                    num_seqs: tl.int32, scale_log2, window, k_scale_ptr, v_scale_ptr,
                    q_st, q_sh, q_sd, o_st, o_sh, o_sd,
                    c_sb, c_skv, c_so, c_sh, c_sd, bt_st,
                    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
                    USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    DOT_F32: tl.constexpr, FP8: tl.constexpr, FP8_BITS: tl.constexpr):
    """Grid (num_tokens // BLOCK_Q + num_seqs, kv_heads): one program per query block
    of BLOCK_Q tokens of one sequence and one KV head; surplus programs exit."""
    q_block = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    q_idx = local * BLOCK_Q + rows // GROUP  # the row's query within its sequence
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * q_st + head[:, None] * q_sh + d[None, :] * q_sd,
                mask=row_ok[:, None], other=0.0)
    # | cached context (ctx) | new tokens (q_len) |: query q_idx sits at ctx + q_idx.
    ctx = seq_len - q_len
    pos = ctx + q_idx
    # Keys this block can see: up to its last valid query (<= seq_len, so a padding
    # sequence, seq_len 0, reads nothing and writes zeros) ...
    hi = ctx + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len)
    lo = 0
    if USE_WINDOW:
        # ... and, with a window, from its first query's window on: whole tiles before
        # it are skipped, not just masked.
        lo = tl.maximum(ctx + local * BLOCK_Q - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_scale, v_scale = _scales(k_scale_ptr, v_scale_ptr, FP8)
    for start in range((lo // TILE_N) * TILE_N, hi, TILE_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, start, pos, seq, hi, window,
                                     cache_ptr, bt_ptr, bt_st, kvh,
                                     c_sb, c_skv, c_so, c_sh, c_sd, scale_log2,
                                     k_scale, v_scale, BLOCK_SIZE, HEAD_DIM, TILE_N,
                                     USE_WINDOW, DOT_PRECISION, DOT_F32, FP8, FP8_BITS)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok[:, None] * o_st + head[:, None] * o_sh + d[None, :] * o_sd,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# See _PER_STEP (its grid carries the count). The split count is a plain argument too:
# one compiled variant serves every batch shape (start-up tuning times several).
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
                                     USE_WINDOW, DOT_PRECISION, DOT_F32, FP8, FP8_BITS)
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


def _check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"the triton attention backend needs a power-of-two head_dim in "
                         f"16..256, got {head_dim}; use the torch backend for this model")


def _cache_strides(kv_layer: torch.Tensor) -> tuple[int, ...]:
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(f"kv_layer must be [num_blocks, 2, block_size, kv_heads, "
                         f"head_dim], got {tuple(kv_layer.shape)}")
    return tuple(kv_layer.stride())


def _fp8_args(kv_layer: torch.Tensor) -> tuple[torch.Tensor, dict[str, bool]]:
    """The cache as the kernels address it, and its float8 flags: off CUDA a float8
    cache is passed as bytes (the interpreter's float8 conversions are wrong)."""
    fp8 = kv_layer.dtype == FP8_DTYPE
    bits = fp8 and not kv_layer.is_cuda
    return (kv_layer.view(torch.uint8) if bits else kv_layer), {"FP8": fp8, "FP8_BITS": bits}


def _scale_args(k_scale: Scale, v_scale: Scale,
                kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales as the kernels take them: float32 device scalars. The engine passes
    its own (engine.kv_scales); plain floats (tests) become tensors here, which a CUDA
    graph's capture could not do. A cache that is not float8 reads no scale: the cache
    itself stands in for the pointers."""
    if kv_layer.dtype != FP8_DTYPE:
        return kv_layer, kv_layer

    def one(s: Scale) -> torch.Tensor:
        if isinstance(s, torch.Tensor):
            return s
        return torch.tensor(float(s), dtype=torch.float32, device=kv_layer.device)

    return one(k_scale), one(v_scale)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: Scale = 1.0, v_scale: Scale = 1.0) -> None:
    """Scatters the new tokens' K/V ([T, KVH, D]) into their slots of `kv_layer` (the
    strided view cache[:, layer]) in one launch; slot -1 (padding) is skipped. A float8
    cache stores K / k_scale and V / v_scale."""
    num_tokens, kv_heads, head_dim = k.shape
    _check_head_dim(head_dim)
    if num_tokens == 0:
        return
    cache, fp8 = _fp8_args(kv_layer)
    _write_kv_kernel[(num_tokens,)](
        k, v, cache, slot_mapping, kv_heads, *_scale_args(k_scale, v_scale, kv_layer),
        *k.stride(), *v.stride(), *_cache_strides(kv_layer), BLOCK_SIZE=kv_layer.shape[2],
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads), **fp8)


def _dot_args(q: torch.Tensor) -> dict[str, str | bool]:
    # tl.dot would round float32 inputs to TF32 on a GPU; the float32 engine must stay
    # token-exact with transformers, so it pays for full-precision dots. Off CUDA (the
    # interpreter) bfloat16 dots are done in float32: its tl.dot mishandles bfloat16.
    return {"DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
            "DOT_F32": not q.is_cuda and q.dtype == torch.bfloat16}


def _group(q: torch.Tensor, kv_layer: torch.Tensor) -> int:
    heads, kv_heads = q.shape[1], kv_layer.shape[3]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} kv heads evenly")
    if q.dtype != kv_layer.dtype and kv_layer.dtype != FP8_DTYPE:
        raise ValueError(f"q is {q.dtype} but the KV cache is {kv_layer.dtype}")
    _check_head_dim(q.shape[2])
    return heads // kv_heads


def _tile_n(q: torch.Tensor) -> int:
    # Keys per tile (any size: blocks are looked up per key). On a GPU 64 amortizes the
    # block-table reads; the largest head dims drop to 32 to bound registers.
    # Untuned: chosen without a GPU to measure on.
    return 64 if q.is_cuda and q.shape[2] <= 128 else 32


def _new_output(q: torch.Tensor, query_start_loc_cpu: list[int]) -> torch.Tensor:
    # The kernels write every row of every sequence (zeros for padding sequences);
    # rows past the last sequence, if any, are zeroed here (known on the host).
    covered = query_start_loc_cpu[-1] == q.shape[0]
    alloc = torch.empty if covered else torch.zeros
    return alloc(q.shape, dtype=q.dtype, device=q.device)


def unified_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      query_start_loc_cpu: list[int], max_query_len: int, scale: float,
                      sliding_window: int | None = None, k_scale: Scale = 1.0,
                      v_scale: Scale = 1.0) -> torch.Tensor:
    """Causal paged attention for any mix of decode rows and prefill chunks over a
    cached prefix, in one launch. q: [T, H, D]; returns a new [T, H, D] in q's dtype."""
    group = _group(q, kv_layer)
    num_tokens, heads, head_dim = q.shape
    num_seqs = query_start_loc.shape[0] - 1
    out = _new_output(q, query_start_loc_cpu)
    if num_tokens == 0 or num_seqs == 0:
        return out
    # Rows per program: at least 16 (tl.dot's minimum); on a GPU, long prefill chunks
    # get 64 rows so that each K/V tile read serves more queries.
    rows = 64 if q.is_cuda and max_query_len >= 64 else 16
    block_m = max(rows, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, kv_layer.shape[3])
    cache, fp8 = _fp8_args(kv_layer)
    _unified_kernel[grid](
        out, q, cache, block_tables, seq_lens, query_start_loc, num_seqs,
        scale * LOG2E, sliding_window or 0, *_scale_args(k_scale, v_scale, kv_layer),
        *q.stride(), *out.stride(),
        *_cache_strides(kv_layer), block_tables.stride(0),
        GROUP=group, BLOCK_SIZE=kv_layer.shape[2], HEAD_DIM=head_dim, BLOCK_M=block_m,
        BLOCK_Q=block_q, TILE_N=_tile_n(q), USE_WINDOW=sliding_window is not None,
        **_dot_args(q), **fp8)
    return out


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
        TILE_N=tile.tile_n or _tile_n(q), USE_WINDOW=sliding_window is not None, num_warps=tile.num_warps,
        num_stages=tile.num_stages, **_dot_args(q), **fp8)
    _decode_reduce_kernel[(num_seqs, heads)](
        out, part, lse, query_start_loc, heads, *out.stride(),
        HEAD_DIM=head_dim, NUM_SPLITS=splits)
    return out
