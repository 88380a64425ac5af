# @triton.jit kernels take untyped parameters (Triton reads annotations itself).
# mypy: allow-untyped-defs
"""Triton kernels for the paged KV cache: the KV write and unified (mixed-batch and
prefill) attention, with the tile step that split-K decode (engine.attention.
triton_decode) shares. Launchers are thin and sync-free.

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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.attention.triton_fp8 import _kv_load, _kv_store
from engine.kv_quant import FP8_DTYPE, Scale

LOG2E = 1.4426950408889634
# Rows per program of the untuned unified kernel: 16 (tl.dot's minimum) for decode rows
# and short chunks; on a GPU, steps with a query of LONG_QUERY tokens or more get 64
# rows, so that each K/V tile read serves more queries.
SHORT_ROWS, LONG_ROWS, LONG_QUERY = 16, 64, 64


@dataclass(frozen=True, slots=True)
class PrefillTile:
    """A launch configuration of the unified kernel (engine.attention.tuning picks one
    per query length on CUDA). Every configuration computes the same attention, up to
    rounding: query rows per program (BLOCK_M, the GQA-packed rows of BLOCK_M // group
    tokens), keys per tile, warps, and the software pipeline's depth over the fully
    visible key tiles (K/V tiles and their block-table entries loaded NUM_STAGES - 1
    iterations ahead). None: the untuned rows (`_block_m`) and keys (`_tile_n`)."""

    block_m: int | None = None
    tile_n: int | None = None
    num_warps: int = 4
    num_stages: int = 3


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
def _query_block(qsl_ptr, seq_lens_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Global query block `q_block`'s sequence, the sequence's first query row and
    query count, the block's index within it and the sequence's length (keys). The
    block is surplus (its program exits) when local * BLOCK_Q >= q_len."""
    seq = _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    return seq, q_start, q_len, local, seq_len


@triton.jit
def _attend_tile(q, acc, m_i, l_i, start, pos, seq, hi, window, cache_ptr, bt_ptr, bt_st,
                 kvh, c_sb, c_skv, c_so, c_sh, c_sd, scale_log2, k_scale, v_scale,
                 BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_N: tl.constexpr,
                 USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 DOT_F32: tl.constexpr, FP8: tl.constexpr, FP8_BITS: tl.constexpr,
                 MASK: tl.constexpr):
    """One online-softmax step over keys start .. start + TILE_N - 1 (those < hi).
    `pos` is each row's absolute query position: a row sees key j iff j <= pos (and,
    with a window, j > pos - window). Softmax runs in base 2 (scale folded in).
    MASK=False: the caller vouches that every row sees every key of the tile (all
    < hi, inside the causal bound and the window), so nothing is masked; the result is
    the masked step's, bit for bit, with the masks' work left out."""
    kpos = start + tl.arange(0, TILE_N)
    d = tl.arange(0, HEAD_DIM)
    if MASK:
        kv_ok = kpos < hi
        blk = tl.load(bt_ptr + seq * bt_st + kpos // BLOCK_SIZE, mask=kv_ok, other=0)
    else:
        blk = tl.load(bt_ptr + seq * bt_st + kpos // BLOCK_SIZE)
    base = cache_ptr + blk.to(tl.int64) * c_sb + (kpos % BLOCK_SIZE) * c_so + kvh * c_sh
    if MASK:
        k = tl.load(base[None, :] + d[:, None] * c_sd, mask=kv_ok[None, :], other=0.0)
        v = tl.load(base[:, None] + c_skv + d[None, :] * c_sd, mask=kv_ok[:, None],
                    other=0.0)
    else:
        k = tl.load(base[None, :] + d[:, None] * c_sd)
        v = tl.load(base[:, None] + c_skv + d[None, :] * c_sd)
    k = _kv_load(k, k_scale, q.dtype, FP8, FP8_BITS)
    v = _kv_load(v, v_scale, q.dtype, FP8, FP8_BITS)
    if DOT_F32:
        # Triton's interpreter multiplies bfloat16 operands as their raw uint16 bits;
        # on the CPU the dots run in float32 (p is still rounded to v's dtype below).
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    if MASK:
        visible = kv_ok[None, :] & (kpos[None, :] <= pos[:, None])
        if USE_WINDOW:
            visible = visible & (kpos[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASK:
        # A row with nothing visible yet keeps m = -inf; shift by 0 there so that
        # exp2(-inf - -inf) never makes a NaN (its p and alpha are then 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new  # every row saw a finite score in this tile
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
                    DOT_F32: tl.constexpr, FP8: tl.constexpr, FP8_BITS: tl.constexpr,
                    NUM_STAGES: tl.constexpr):
    """Grid (num_tokens // BLOCK_Q + num_seqs, kv_heads): one program per query block
    of BLOCK_Q tokens of one sequence and one KV head; surplus programs exit. Programs
    take query blocks last first: under the causal mask a sequence's later blocks see
    the most keys, and a GPU starts programs roughly in order, so the longest run first
    and the short ones fill the tail (as FlashAttention schedules causal blocks)."""
    q_block = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    seq, q_start, q_len, local, seq_len = _query_block(qsl_ptr, seq_lens_ptr, q_block,
                                                       num_seqs, BLOCK_Q)
    if local * BLOCK_Q >= q_len:
        return
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
    # sequence, seq_len 0, reads nothing and writes zeros); tiles past it are never
    # visited. With a window, from its first query's window on: whole tiles before it
    # are skipped, not just masked.
    first = ctx + local * BLOCK_Q  # the block's first query position
    hi = ctx + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    # The key tiles, TILE_N-aligned from t0, in three runs (the same tiles in the same
    # order as one masked loop would take, so the sums are the same):
    #   | window edge: masked | every row sees every key: no mask | diagonal: masked |
    #   t0                    a                                   b                  hi
    # b: the end of the tiles wholly at or before the first query; a: the start of those
    # wholly inside the last query's window (t0 without a window).
    t0 = (lo // TILE_N) * TILE_N
    b = tl.maximum(((first + 1) // TILE_N) * TILE_N, t0)
    a = t0
    if USE_WINDOW:
        edge = tl.maximum(hi - window, 0)  # the last query's first visible key
        a = tl.minimum(tl.maximum(tl.cdiv(edge, TILE_N) * TILE_N, t0), b)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_scale, v_scale = _scales(k_scale_ptr, v_scale_ptr, FP8)
    for start in range(t0, a, TILE_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, start, pos, seq, hi, window,
                                     cache_ptr, bt_ptr, bt_st, kvh,
                                     c_sb, c_skv, c_so, c_sh, c_sd, scale_log2,
                                     k_scale, v_scale, BLOCK_SIZE, HEAD_DIM, TILE_N,
                                     USE_WINDOW, DOT_PRECISION, DOT_F32, FP8, FP8_BITS, True)
    # The bulk of a long prefill: the next tiles' K/V and block-table loads are issued
    # NUM_STAGES - 1 iterations ahead of the dots (FlashAttention-2's pipelining).
    for start in tl.range(a, b, TILE_N, num_stages=NUM_STAGES):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, start, pos, seq, hi, window,
                                     cache_ptr, bt_ptr, bt_st, kvh,
                                     c_sb, c_skv, c_so, c_sh, c_sd, scale_log2,
                                     k_scale, v_scale, BLOCK_SIZE, HEAD_DIM, TILE_N,
                                     USE_WINDOW, DOT_PRECISION, DOT_F32, FP8, FP8_BITS, False)
    for start in range(b, hi, TILE_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, start, pos, seq, hi, window,
                                     cache_ptr, bt_ptr, bt_st, kvh,
                                     c_sb, c_skv, c_so, c_sh, c_sd, scale_log2,
                                     k_scale, v_scale, BLOCK_SIZE, HEAD_DIM, TILE_N,
                                     USE_WINDOW, DOT_PRECISION, DOT_F32, FP8, FP8_BITS, True)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok[:, None] * o_st + head[:, None] * o_sh + d[None, :] * o_sd,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


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


def _block_m(q: torch.Tensor, max_query_len: int) -> int:
    # Untuned: chosen without a GPU to measure on (see SHORT_ROWS).
    return LONG_ROWS if q.is_cuda and max_query_len >= LONG_QUERY else SHORT_ROWS


def unified_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      query_start_loc_cpu: list[int], max_query_len: int, scale: float,
                      sliding_window: int | None = None, k_scale: Scale = 1.0,
                      v_scale: Scale = 1.0, tile: PrefillTile | None = None) -> torch.Tensor:
    """Causal paged attention for any mix of decode rows and prefill chunks over a
    cached prefix, in one launch. q: [T, H, D]; returns a new [T, H, D] in q's dtype.
    `tile` configures the launch (default: PrefillTile(), the untuned one); its rows
    are raised to the GQA group's power of two where fewer."""
    group = _group(q, kv_layer)
    num_tokens, heads, head_dim = q.shape
    num_seqs = query_start_loc.shape[0] - 1
    out = _new_output(q, query_start_loc_cpu)
    if num_tokens == 0 or num_seqs == 0:
        return out
    tile = tile or PrefillTile()
    block_m = max(tile.block_m or _block_m(q, max_query_len), triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, kv_layer.shape[3])
    cache, fp8 = _fp8_args(kv_layer)
    _unified_kernel[grid](
        out, q, cache, block_tables, seq_lens, query_start_loc, num_seqs,
        scale * LOG2E, sliding_window or 0, *_scale_args(k_scale, v_scale, kv_layer),
        *q.stride(), *out.stride(),
        *_cache_strides(kv_layer), block_tables.stride(0),
        GROUP=group, BLOCK_SIZE=kv_layer.shape[2], HEAD_DIM=head_dim, BLOCK_M=block_m,
        BLOCK_Q=block_q, TILE_N=tile.tile_n or _tile_n(q),
        USE_WINDOW=sliding_window is not None, NUM_STAGES=tile.num_stages,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **_dot_args(q), **fp8)
    return out
