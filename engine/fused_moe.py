"""Fused mixture-of-experts in Triton, as vLLM's fused_moe: the (token, slot) pairs are
sorted by expert and each expert's run padded to a multiple of BLOCK_M, so one program
multiplies a BLOCK_M x BLOCK_N tile of rows that all go to one expert. Two grouped GEMMs:
gate_up (x @ w13[e].T, then SiLU(gate) * up), and down (@ w2[e].T) with the routing
weight applied in the epilogue; the k slots of a token are summed last.

Nothing here reads a tensor's values on the host: the grid is sized from shapes (the
worst-case padding), blocks past the real padded length exit at once, so a decode step
can be captured in a CUDA graph. engine.models.moe.fused_experts_ref is the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import kernels


@triton.jit(do_not_specialize=["num_pairs"])  # (T x top-k: one variant for every step)
def _moe_gemm_kernel(a_ptr: tl.tensor, b_ptr: tl.tensor, c_ptr: tl.tensor,
                     weight_ptr: tl.tensor, sorted_ptr: tl.tensor, expert_ptr: tl.tensor,
                     padded_len_ptr: tl.tensor, n: tl.tensor, k: tl.tensor,
                     num_pairs: tl.tensor, stride_am: tl.tensor, stride_be: tl.tensor,
                     stride_bn: tl.tensor, stride_cm: tl.tensor,
                     A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                     UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr) -> None:
    # c[pair, :] = a[pair // A_ROW_DIV, :] @ b[expert].T (* weight[pair]) for the BLOCK_M
    # pairs of this block, all routed to one expert; rows are contiguous in k.
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(n, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    if pid_m * BLOCK_M >= tl.load(padded_len_ptr):
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs  # padding slots hold num_pairs
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = pairs // A_ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_ok = (k0 + offs_k) < k
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=(offs_n[None, :] < n) & k_ok[:, None], other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:  # float32 in, float32 products: no TF32 rounding of the inputs
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < n))


# Triton's CPU interpreter multiplies 16-bit floats in tl.dot as raw bits: there the
# tiles are upcast first, which is what the GPU's bf16 / fp16 dot computes anyway (exact
# products, float32 sums).
_INTERPRETED = type(_moe_gemm_kernel).__name__ == "InterpretedFunction"


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorts the T*k (token, slot) pairs (pair = t * k + slot) by expert, each expert's run
    padded to a multiple of block_m. Returns (sorted_pairs [P], expert_of_block
    [P // block_m], padded_len [1]); P is the worst-case padded length (shape-only),
    unused slots hold T*k. Host-sync free."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    max_len = min(num_pairs * block_m, num_pairs + num_experts * (block_m - 1))
    max_len = triton.cdiv(max_len, block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    # | expert 0's pairs | pad | expert 1's pairs | pad | ... : rank within the expert's run
    first_of_expert = counts.cumsum(0) - counts
    rank = torch.arange(num_pairs, device=device) - first_of_expert[experts_sorted]
    sorted_pairs = torch.full((max_len,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs[padded_start[experts_sorted] + rank] = order
    block_starts = torch.arange(0, max_len, block_m, device=device)
    expert_of_block = torch.searchsorted(padded_end, block_starts, right=True)
    expert_of_block.clamp_(max=num_experts - 1)  # blocks past the end exit before reading
    return sorted_pairs, expert_of_block, padded_end[-1:]


def _tiles(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    # vLLM's default tiling: small tiles when few rows per expert (decode).
    if num_pairs <= num_experts:
        return 16, 32, 64
    return 64, 64, 32


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor,
          sorted_pairs: torch.Tensor, expert_of_block: torch.Tensor, padded_len: torch.Tensor,
          a_row_div: int, mul_weight: bool, tiles: tuple[int, int, int]) -> None:
    block_m, block_n, block_k = tiles
    n, k = b.shape[1], b.shape[2]
    grid = (expert_of_block.numel() * triton.cdiv(n, block_n),)
    _moe_gemm_kernel[grid](
        a, b, out, weights, sorted_pairs, expert_of_block, padded_len, n, k,
        out.shape[0], a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=mul_weight,
        IEEE=a.dtype == torch.float32 or _INTERPRETED, UPCAST=_INTERPRETED,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * (SiLU(x w13[e]_gate^T) * x w13[e]_up^T) w2[e]^T with
    e = topk_ids[t, k], for x [T, H], w13 [E, 2I, H], w2 [E, H, I]; a new [T, H] tensor
    in x's dtype. Weights must be contiguous in their last dim."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    if w13.shape[2] != hidden or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not fit "
                         f"hidden size {hidden}")
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("expert weights must be contiguous in their last dim")
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    num_pairs = num_tokens * top_k
    tiles = _tiles(num_pairs, num_experts)
    sorted_pairs, expert_of_block, padded_len = moe_align_block_size(
        topk_ids, num_experts, tiles[0])
    weights = topk_weights.reshape(-1).float().contiguous()
    gate_up = torch.empty(num_pairs, two_inter, dtype=x.dtype, device=x.device)
    _gemm(x, w13, gate_up, weights, sorted_pairs, expert_of_block, padded_len,
          top_k, False, tiles)
    act = kernels.silu_and_mul(gate_up)
    down = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _gemm(act, w2, down, weights, sorted_pairs, expert_of_block, padded_len, 1, True, tiles)
    return down.view(num_tokens, top_k, hidden).sum(dim=1)
