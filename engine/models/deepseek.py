"""DeepSeek-V2 / V3 decoder over a paged latent KV cache (MLA), computed as
transformers computes it.

Attention is multi-head latent attention (engine.attention.mla): queries through an
optional low-rank (q_a -> norm -> q_b), one compressed KV latent plus a shared rope key
per token, and the cache holds only those. The MLP of layers below
`first_k_dense_replace` is dense; the others are mixtures of experts
(engine.models.moe) plus shared experts. V2 routes by softmax (greedy or
group-limited), V3 by sigmoid with a selection bias and group-limited top-k.
Rope runs on the rope part of q and k only, with yarn scaling and its mscale.

Under tensor parallelism (`tp`) the model is built from the rank's share of the shape
(ModelConfig.shard): its query heads (q / q_b, kv_b and o_proj split by head) and its
slice of every MLP's intermediate size (dense, shared and routed experts). The latent
(kv_a_proj_with_mqa, kv_a_layernorm) is whole on every rank, so every rank caches the
same latent: the simplest correct choice, which keeps the hand-off per rank unchanged.
o_proj and each MLP end in one all-reduce; the vocabulary is split over ranks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.mla import MLABackend, TorchMLABackend, make_mla_backend
from engine.config import DeepseekRouting, MLAConfig, ModelConfig, RopeConfig
from engine.models.llama import MLP, CausalLM, DecoderModel, RMSNorm, rope_inv_freq
from engine.models.moe import SparseMoeBlock

if TYPE_CHECKING:

    from engine.distributed import TPGroup


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) of yarn, as transformers' _compute_yarn_parameters."""
    base, factor = rope.theta, rope.factor
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = yarn_mscale(factor, rope.mscale) / yarn_mscale(
                factor, rope.mscale_all_dim)
        else:
            attention = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


def deepseek_rope(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq over qk_rope_head_dim, the factor cos/sin are scaled by)."""
    assert cfg.mla is not None
    dim = cfg.mla.qk_rope_head_dim
    if cfg.rope.rope_type == "yarn":
        return yarn_inv_freq(cfg.rope, dim)
    return rope_inv_freq(cfg.rope, dim), 1.0


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn."""
    assert cfg.mla is not None
    scale = (cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim) ** -0.5
    if cfg.rope.rope_type != "default" and cfg.rope.mscale_all_dim:
        m = yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleave: bool) -> torch.Tensor:
    """x [T, heads, rope]; cos/sin [T, 1, rope/2]. Interleaved: pairs (x0, x1), (x2, x3)
    rotate together and come out as (evens | odds), as transformers' DeepSeek-V3 (and,
    up to that fixed permutation applied to q and k alike, V2's complex rotation)."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, mla: MLAConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.mla, self.tp = mla, tp
        self.num_heads = cfg.num_heads
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        h = cfg.hidden_size
        bias = cfg.qkv_bias  # transformers' attention_bias: q_a, kv_a and o projections
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, self.num_heads * self.qk_head_dim,
                                      bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim,
                                            bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim),
            bias=False)
        self.o_proj = nn.Linear(self.num_heads * mla.v_head_dim, h, bias=bias)
        self.scale = softmax_scale(cfg)
        self.backend: MLABackend = TorchMLABackend()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, mla = x.shape[0], self.mla
        if mla.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.num_heads, self.qk_head_dim).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_pe = apply_rope(q_pe, cos, sin, mla.rope_interleave)
        k_pe = apply_rope(k_pe.unsqueeze(1), cos, sin, mla.rope_interleave).squeeze(1)
        o = self.backend.forward(q_nope, q_pe, latent, k_pe, kv_layer, meta, self.scale,
                                 self.kv_b_proj.weight)
        o = o.reshape(t, self.num_heads * mla.v_head_dim)
        if self.tp is None:
            return self.o_proj(o)
        # row-parallel: the ranks' partial sums meet first, the bias is added once
        out = self.tp.all_reduce(F.linear(o, self.o_proj.weight))
        return out if self.o_proj.bias is None else out + self.o_proj.bias


class DeepseekMoE(SparseMoeBlock):
    """Routed experts (SparseMoeBlock: gate, w13, w2) plus the shared experts, one
    dense MLP of n_shared_experts * moe_intermediate_size, added to every token. Under
    TP both are this rank's slices, summed before the one all-reduce."""

    def __init__(self, cfg: ModelConfig, routing: DeepseekRouting,
                 tp: TPGroup | None = None) -> None:
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                         cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob,
                         scoring=routing.scoring, correction_bias=routing.correction_bias,
                         router_float32=True, n_group=routing.n_group,
                         topk_group=routing.topk_group,
                         routed_scaling_factor=routing.routed_scaling_factor, tp=tp)
        self.shared_experts = (
            MLP(cfg, cfg.moe_intermediate_size * routing.n_shared_experts)
            if routing.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.routed(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if self.tp is None else self.tp.all_reduce(out)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        assert cfg.mla is not None
        self.self_attn = MLAttention(cfg, cfg.mla, tp)
        self.mlp: nn.Module = (DeepseekMoE(cfg, cfg.routing, tp)
                               if cfg.routing is not None and index in cfg.sparse_layers
                               else MLP(cfg, tp=tp))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, cos, sin, kv_layer, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class DeepseekForCausalLM(CausalLM):
    """DeepSeek-V2 / V3 over a flat batch of tokens from many sequences (no padding);
    the same interface as LlamaForCausalLM. With `tp`, `cfg` is this rank's share of
    the shape (ModelConfig.shard)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        if cfg.mla is None:
            raise ValueError("DeepseekForCausalLM needs an MLA config")
        super().__init__(cfg, tp, DecoderModel(cfg, tp, DeepseekDecoderLayer))
        with torch.device("cpu"):  # not on meta (make_embedding says why); moved later
            inv_freq, self.rope_factor = deepseek_rope(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def set_kernels(self, backend: AttentionBackend, fused: bool, max_positions: int) -> None:
        """The MLA backend paired with `backend` (torch | triton) and, with `fused`,
        the Triton RMSNorm / SiLU*mul kernels (engine.kernels)."""
        self.use_kernels(fused, MLAttention, make_mla_backend(backend.name))

    def rope_cos_sin(self, positions: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rope/2], scaled by yarn's attention factor."""
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        freqs = positions.float().unsqueeze(1) * inv_freq.float().unsqueeze(0)
        cos, sin = freqs.cos() * self.rope_factor, freqs.sin() * self.rope_factor
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: the block-major latent cache. Returns
        hidden [T, H]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos_sin(positions, x.dtype)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos, sin, kv_cache[:, i], meta)
        return self.model.final_norm(x, residual)
