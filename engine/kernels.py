"""Fused elementwise Triton kernels for the decoder's forward pass.

Each kernel replaces a chain of small torch ops (RMSNorm's upcast/mean/rsqrt/cast/scale,
rotary's cat/mul/add, SwiGLU's silu/mul) with one launch, and reproduces the rounding of
the torch reference in engine/models/llama.py step by step: every place where eager torch
materialises an intermediate in the model dtype, the kernel rounds to that dtype too, so
bf16 outputs match Hugging Face transformers, not merely a more accurate float32 result.

Launchers only read tensor metadata (shapes, strides, dtypes), never tensor values, so they
never synchronise with the host and can run inside CUDA-graph-captured decode steps. Only
Triton features that also exist in Triton 3.6 are used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round_to(x: tl.tensor, dtype: tl.constexpr) -> tl.tensor:
    """float32 `x` rounded to `dtype` (round to nearest even) and held in float32 again.

    bfloat16 is rounded by bit arithmetic rather than `.to(tl.bfloat16)`: compiled Triton
    rounds to nearest even, but the CPU interpreter the tests run under truncates, which
    would make the tests compare against a different arithmetic than the GPU's.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        # Add 0x7FFF plus the lowest kept bit, then drop the low 16 bits: ties go to even.
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        out = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # keep NaN a NaN
    elif dtype == tl.float32:
        out = x
    else:
        out = x.to(dtype).to(tl.float32)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr: tl.tensor, res_ptr: tl.tensor, w_ptr: tl.tensor,
                     out_ptr: tl.tensor, res_out_ptr: tl.tensor,
                     x_stride: tl.tensor, res_stride: tl.tensor, out_stride: tl.tensor,
                     res_out_stride: tl.tensor, hidden: tl.tensor, eps: tl.tensor,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr) -> None:
    # One program per row; the whole row sits in registers, so x is read from memory once.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # `x + residual` in torch rounds the sum to the input dtype before the norm sees it.
        x = _round_to(x + r, x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
    # Masked lanes load 0, so they add nothing to the sum of squares.
    variance = tl.sum(x * x, axis=0) / hidden
    normed = _round_to(x * tl.rsqrt(variance + eps), x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _round_to(normed * w, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + cols, y, mask=mask)


def _row_num_warps(block: int) -> int:
    # About 256 elements per warp keeps registers per thread low without idle warps.
    return max(1, min(8, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm over the last dim of x [..., H], optionally fused with the residual add.

    Without `residual`: returns (norm(x) * weight, None). With it: r = x + residual (rounded
    to x's dtype, as torch's add), returns (norm(r) * weight, r). Inputs are not modified;
    both results are new tensors owned by the caller. The output dtype is torch's promotion
    of weight and x dtypes, as in `weight * normed` (the model dtype when they agree).
    """
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({hidden},)")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    x2 = _rows(x)
    res2 = _rows(residual) if residual is not None else x2
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                      device=x.device)
    res_out = torch.empty_like(x2) if residual is not None else None
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        # Without a residual the residual pointers are never dereferenced (HAS_RESIDUAL
        # prunes that branch at compile time); x2/out stand in so the signature stays fixed.
        res_dst = res_out if res_out is not None else out
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight.contiguous(), out, res_dst,
            x2.stride(0), res2.stride(0), out.stride(0), res_dst.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_row_num_warps(block))
    return out.view(x.shape), res_out.view(x.shape) if res_out is not None else None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, last] tensor whose last dim is unit-stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def build_cos_sin_cache(inv_freq: torch.Tensor, max_pos: int) -> torch.Tensor:
    """[max_pos, D] float32: cos(pos * inv_freq) in the first D/2 columns, sin in the last.

    Same arithmetic as LlamaForCausalLM.rope_cos_sin (int64 positions cast to float32, times
    float32 inv_freq). HF's cos/sin are cat(freqs, freqs), so each half is stored once.
    """
    positions = torch.arange(max_pos, dtype=torch.int64, device=inv_freq.device)
    freqs = positions.float().unsqueeze(1) * inv_freq.float().unsqueeze(0)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@triton.jit
def _rotate_heads(base_ptr: tl.tensor, stride_h: tl.tensor, stride_d: tl.tensor,
                  num_heads: tl.tensor, half: tl.tensor, cos: tl.tensor, sin: tl.tensor,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr) -> None:
    # One token's heads as a [heads, D/2] tile per half:  | x1 = x[:D/2] | x2 = x[D/2:] |
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < half)
    p1 = base_ptr + heads * stride_h + dims * stride_d
    p2 = p1 + half * stride_d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    dtype = base_ptr.dtype.element_ty
    c = cos[None, :]
    s = sin[None, :]
    # x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1). Eager torch rounds
    # each product and the sum to the model dtype; so do we (negation is exact).
    o1 = _round_to(_round_to(x1 * c, dtype) - _round_to(x2 * s, dtype), dtype)
    o2 = _round_to(_round_to(x2 * c, dtype) + _round_to(x1 * s, dtype), dtype)
    tl.store(p1, o1, mask=mask)
    tl.store(p2, o2, mask=mask)


@triton.jit
def _rotary_kernel(q_ptr: tl.tensor, k_ptr: tl.tensor, pos_ptr: tl.tensor, cache_ptr: tl.tensor,
                   q_stride_t: tl.tensor, q_stride_h: tl.tensor, q_stride_d: tl.tensor,
                   k_stride_t: tl.tensor, k_stride_h: tl.tensor, k_stride_d: tl.tensor,
                   cache_stride: tl.tensor, num_q_heads: tl.tensor, num_k_heads: tl.tensor,
                   half: tl.tensor, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   BLOCK_D: tl.constexpr) -> None:
    # One program per token: its cos/sin row is loaded once and shared by all q and k heads.
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < half
    dtype = q_ptr.dtype.element_ty
    # HF casts cos/sin to the model dtype before multiplying; round the same way.
    cos = _round_to(tl.load(cache_ptr + pos * cache_stride + dims, mask=dmask, other=0.0),
                    dtype)
    sin = _round_to(tl.load(cache_ptr + pos * cache_stride + half + dims, mask=dmask,
                            other=0.0), dtype)
    _rotate_heads(q_ptr + tok * q_stride_t, q_stride_h, q_stride_d, num_q_heads, half,
                  cos, sin, BLOCK_HQ, BLOCK_D)
    _rotate_heads(k_ptr + tok * k_stride_t, k_stride_h, k_stride_d, num_k_heads, half,
                  cos, sin, BLOCK_HK, BLOCK_D)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (rotate-half convention, as HF).

    q and k may be strided views (e.g. split out of a fused qkv output); they are written
    through their strides. positions [T] int64 index rows of cos_sin_cache [max_pos, D]
    (from build_cos_sin_cache); positions >= max_pos are not checked (that would need a host
    sync) and read out of bounds.
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, D] "
                         "with the same T and D")
    if q.dtype != k.dtype:
        raise ValueError(f"q dtype {q.dtype} != k dtype {k.dtype}")
    num_tokens, num_q_heads, head_dim = q.shape
    if head_dim % 2 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} must be [max_pos, "
                         f"{head_dim}] and head_dim even")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions {tuple(positions.shape)} != ({num_tokens},)")
    if num_tokens == 0:
        return
    half = head_dim // 2
    cache = cos_sin_cache.contiguous()
    block_hq, block_hk = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(k.shape[1])
    block_d = triton.next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        q, k, positions.contiguous(), cache,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        cache.stride(0), num_q_heads, k.shape[1], half,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d,
        num_warps=_row_num_warps(block_hq * block_d))


@triton.jit
def _silu_and_mul_kernel(x_ptr: tl.tensor, out_ptr: tl.tensor, x_stride: tl.tensor,
                         out_stride: tl.tensor, inter: tl.tensor,
                         BLOCK: tl.constexpr) -> None:
    # Grid (rows, column blocks):  x row = | gate [0, I) | up [I, 2I) |
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    # F.silu computes x / (1 + exp(-x)) in float32 and rounds to the dtype; `* up` rounds again.
    act = _round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * out_stride + cols, _round_to(act * up, dtype), mask=mask)


_SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate then up) -> new tensor [..., I] = silu(gate) * up, in x's dtype."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} of x must be even (gate and up halves)")
    inter = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and inter > 0:
        block = min(_SILU_BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block,
            num_warps=_row_num_warps(block))
    return out.view(*x.shape[:-1], inter)


@triton.jit
def _mix32(x: tl.tensor) -> tl.tensor:
    # lowbias32 on uint32 (engine.sampler._mix32_np): products wrap mod 2**32, shifts
    # of unsigned values are logical.
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _race_kernel(x_ptr: tl.tensor, x_stride: tl.tensor, t_ptr: tl.tensor, k1_ptr: tl.tensor,
                 k2_ptr: tl.tensor, best_ptr: tl.tensor, arg_ptr: tl.tensor, vocab: tl.tensor,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr) -> None:
    # Program (row, c) races the row's entries [c * CHUNK, (c + 1) * CHUNK): their
    # noise is hashed in registers, the best score and its first index written out.
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    t = tl.load(t_ptr + row)
    k1 = tl.load(k1_ptr + row).to(tl.uint32)
    k2 = tl.load(k2_ptr + row).to(tl.uint32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    arg = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        logit = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=float("-inf"))
        h = _mix32(k1 + cols.to(tl.uint32) * 0x9E3779B9)
        h = _mix32(h ^ k2)
        u = ((h >> 9).to(tl.int32).to(tl.float32) + 0.5) * 1.1920928955078125e-07
        # IEEE division (the default fp32 `/` is approximate): the bits of torch's
        # `logits / t`, whether the sampler or this kernel divides
        score = tl.math.div_rn(logit.to(tl.float32), t) - tl.log(-tl.log(u))
        score = tl.where(score != score, float("inf"), score)  # NaN wins, as in argmax
        # Strictly greater: a lane keeps its first index on ties; and a lane's first
        # entry is always taken, so a row of -inf picks its first entry, as argmax.
        take = ((score > best) | (arg == 2147483647)) & mask
        best = tl.where(take, score, best)
        arg = tl.where(take, cols, arg)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, arg, 2147483647), axis=0)
    n_chunks = tl.num_programs(1)
    tl.store(best_ptr + row * n_chunks + chunk, top)
    tl.store(arg_ptr + row * n_chunks + chunk, first)


_RACE_CHUNK = 8192


def gumbel_race(logits: torch.Tensor, temperatures: torch.Tensor, k1: torch.Tensor,
                k2: torch.Tensor) -> torch.Tensor:
    """engine.sampler.gumbel_race fused: row b's argmax over v of logits[b, v] /
    temperatures[b] - log(-log U(b, v)), the uniforms hashed from the row's keys `k1`,
    `k2` (int64 holding 32-bit values) in registers. logits [B, V] (rows contiguous) are
    read once; each row is split into chunks of 8192 entries raced by their own
    programs, then the chunks' winners (first index on ties and NaN as the largest, as
    torch.argmax)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    b, vocab = logits.shape
    n_chunks = triton.cdiv(vocab, _RACE_CHUNK)
    best = torch.empty(b, n_chunks, dtype=torch.float32, device=logits.device)
    arg = torch.empty(b, n_chunks, dtype=torch.int32, device=logits.device)
    if b:
        # (the per-row columns may be strided views of one parameter table)
        t, k1, k2 = (x.contiguous() for x in (temperatures.float(), k1, k2))
        _race_kernel[(b, n_chunks)](logits, logits.stride(0), t, k1, k2, best, arg, vocab,
                                    CHUNK=_RACE_CHUNK, BLOCK=1024, num_warps=4)
    return arg.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1).to(torch.int64)
