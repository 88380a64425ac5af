"""Mixture-of-experts: routing (`select_experts`), the expert dispatch (`fused_experts`)
and the block that model files use (`SparseMoeBlock`).

`fused_experts` is the one place tokens meet experts: the torch loop below is the
reference (and the CPU path); on CUDA the Triton grouped GEMM in engine.fused_moe runs
instead. Expert parallelism replaces this one function.

Expert weights are stacked: w13 [E, 2*I, H] holds each expert's gate rows then up
rows (Hugging Face's gate_proj / up_proj, Mixtral's w1 / w3); w2 [E, H, I] its down
projection (down_proj / w2). Under tensor parallelism I is this rank's slice of each
expert's intermediate size; the router is whole, and the block ends in one all-reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from engine.distributed import TPGroup

SCORINGS = ("softmax", "sigmoid")


def select_experts(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
                   renormalize: bool, e_score_correction_bias: torch.Tensor | None = None,
                   n_group: int | None = None, topk_group: int | None = None,
                   routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (topk_weights float32 [T, k], topk_ids int64 [T, k]) for router_logits [T, E].

    softmax: Qwen3-MoE / Mixtral (top-k of the probabilities, renormalised if asked) and
    DeepSeek-V2 (with n_group / topk_group: groups ranked by their best expert, experts
    outside the chosen groups scored 0). sigmoid: DeepSeek-V3 (the bias shifts the
    choice only; groups ranked by the sum of their two best biased scores; the weights
    are the unbiased scores). Each follows its transformers router op for op, so the
    float32 results are bit-identical."""
    if scoring not in SCORINGS:
        raise ValueError(f"unknown expert scoring {scoring!r}; choose from {SCORINGS}")
    num_experts = router_logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, {num_experts}]")
    if n_group is not None and (n_group <= 0 or num_experts % n_group):
        raise ValueError(f"{num_experts} experts do not split into {n_group} groups")
    logits = router_logits.float()
    if scoring == "softmax":
        if e_score_correction_bias is not None:
            raise ValueError("e_score_correction_bias goes with sigmoid scoring")
        scores = logits.softmax(dim=-1)
        if n_group is None or n_group <= 1:
            weights, ids = torch.topk(scores, top_k, dim=-1)
        else:
            group_scores = scores.view(-1, n_group, num_experts // n_group).max(dim=-1).values
            mask = _group_mask(group_scores, n_group, num_experts, _topk_group(topk_group))
            weights, ids = torch.topk(scores.masked_fill(~mask, 0.0), top_k, dim=-1,
                                      sorted=False)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = logits.sigmoid()
        choice = scores if e_score_correction_bias is None else (
            scores + e_score_correction_bias.float())
        groups = n_group or 1
        group_scores = choice.view(-1, groups, num_experts // groups).topk(
            min(2, num_experts // groups), dim=-1)[0].sum(dim=-1)
        mask = _group_mask(group_scores, groups, num_experts, _topk_group(topk_group))
        ids = torch.topk(choice.masked_fill(~mask, float("-inf")), top_k, dim=-1,
                         sorted=False)[1]
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int64)


def _topk_group(topk_group: int | None) -> int:
    return 1 if topk_group is None else topk_group


def _group_mask(group_scores: torch.Tensor, n_group: int, num_experts: int,
                topk_group: int) -> torch.Tensor:
    """[T, E] bool: True for the experts of each token's topk_group best groups."""
    if not 0 < topk_group <= n_group:
        raise ValueError(f"topk_group {topk_group} must be in [1, {n_group}]")
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    return group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(
        -1, num_experts).bool()


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  use_triton: bool | None = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for x [T, H]; returns a
    new [T, H] tensor in x's dtype. use_triton None: the Triton kernel on CUDA, the torch
    reference elsewhere."""
    if use_triton is None:
        use_triton = x.is_cuda
    if use_triton:
        from engine.fused_moe import fused_moe

        return fused_moe(x, w13, w2, topk_weights, topk_ids)
    return fused_experts_ref(x, w13, w2, topk_weights, topk_ids)


def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The loop over experts, as transformers' Experts modules: each hit expert runs its
    tokens, the weighted outputs accumulate into the token rows in expert order."""
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for e in torch.unique(topk_ids).tolist():
        tok, pos = torch.where(topk_ids == e)
        gate, up = F.linear(x[tok], w13[e]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * topk_weights[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


class Router(nn.Module):
    """The gate: router logits x @ weight.T (in float32 when `float32`, as DeepSeek),
    plus DeepSeek-V3's per-expert selection bias when it has one."""

    def __init__(self, hidden_size: int, num_experts: int, *, float32: bool = False,
                 correction_bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.float32 = float32
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts), requires_grad=False)
            if correction_bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32:
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """Router + stacked experts for x [T, H] -> [T, H] (no shared experts: a model
    that has them adds their output itself). Parameters: gate.weight [E, H],
    w13 [E, 2*I, H], w2 [E, H, I] (and gate.e_score_correction_bias [E] if asked)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int,
                 top_k: int, *, renormalize: bool, scoring: str = "softmax",
                 correction_bias: bool = False, router_float32: bool = False,
                 n_group: int | None = None, topk_group: int | None = None,
                 routed_scaling_factor: float = 1.0, round_weights: bool = False,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        if scoring not in SCORINGS:
            raise ValueError(f"unknown expert scoring {scoring!r}; choose from {SCORINGS}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, {num_experts}]")
        self.num_experts, self.top_k, self.intermediate_size = (
            num_experts, top_k, intermediate_size)
        self.renormalize, self.scoring = renormalize, scoring
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        # Qwen3-MoE rounds the routing weights to the model dtype before they scale the
        # experts' outputs; Mixtral and DeepSeek keep them in float32.
        self.round_weights = round_weights
        self.gate = Router(hidden_size, num_experts, float32=router_float32,
                           correction_bias=correction_bias)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.use_triton: bool | None = None  # None: by device (see fused_experts)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output; under TP this rank's partial sum (its slice of
        each expert's intermediate size), before the all-reduce."""
        weights, ids = select_experts(
            self.gate(x), self.top_k, scoring=self.scoring, renormalize=self.renormalize,
            e_score_correction_bias=self.gate.e_score_correction_bias,
            n_group=self.n_group, topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor)
        if self.round_weights and x.dtype != weights.dtype:
            weights = weights.to(x.dtype).float()
        return fused_experts(x, self.w13, self.w2, weights, ids, use_triton=self.use_triton)
