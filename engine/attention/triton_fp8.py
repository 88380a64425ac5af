# @triton.jit functions take untyped parameters (Triton reads annotations itself).
# mypy: allow-untyped-defs
"""The float8 e4m3 KV cache's store and load inside the Triton attention kernels
(engine.attention.triton_attn). On a GPU the conversions are Triton's own; off CUDA
(the interpreter, whose float8 conversions are wrong) the cache is seen as bytes and
e4m3 is encoded / decoded in integer arithmetic, bit-exact with torch's conversion."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e4m3_bits(x):
    """float32 (already within +-448) -> its float8 e4m3fn code as uint8, rounded to
    nearest even as torch's conversion does."""
    a = tl.abs(x)
    ab = a.to(tl.int32, bitcast=True)
    # Normal numbers: round the float32 mantissa to 3 bits (a carry moves the exponent).
    r = (ab + 0x7FFFF + ((ab >> 20) & 1)) & -0x100000
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # Subnormals (below 2**-6): multiples of 2**-9; adding 2**14 rounds to them (RNE).
    sub = (((a + 16384.0) - 16384.0) * 512.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    negative = x.to(tl.int32, bitcast=True) < 0  # the sign bit (-0.0 included)
    return tl.where(negative, code | 0x80, code).to(tl.uint8)


@triton.jit
def _e4m3_value(c):
    """A float8 e4m3fn code (uint8) -> its float32 value."""
    c = c.to(tl.int32)
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    a = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((c & 0x80) != 0, -a, a)


@triton.jit
def _kv_store(x, scale, cache_ptr, FP8: tl.constexpr, FP8_BITS: tl.constexpr):
    """A K or V tile as the cache stores it (float8: x / scale, clamped to +-448)."""
    if FP8:
        y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0)
        if FP8_BITS:
            return _e4m3_bits(y)
        return y.to(cache_ptr.dtype.element_ty)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _kv_load(x, scale, dtype, FP8: tl.constexpr, FP8_BITS: tl.constexpr):
    """A loaded K or V tile in the compute dtype (float8: stored value * scale)."""
    # One return: Triton's compiler sees the early return of a constexpr branch and the
    # final one together, and refuses their different types (float8 in, bf16 out).
    y = x
    if FP8:
        if FP8_BITS:
            y = (_e4m3_value(x) * scale).to(dtype)
        else:
            y = (x.to(tl.float32) * scale).to(dtype)
    return y
