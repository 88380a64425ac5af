"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral) over
a paged KV cache.

One class covers the family; the differences are flags in ModelConfig: QKV bias
(Qwen2), per-head q/k RMSNorm (Qwen3), llama3 RoPE scaling, sliding window (Mistral),
mixture-of-experts MLPs in the config's sparse layers (Qwen3-MoE, Mixtral).
Projections are fused (qkv, gate_up) for fewer, larger matmuls; the loader splits
Hugging Face's separate weights into them.

Under tensor parallelism (`tp`, engine/models/parallel_layers.py) the model is built
from the rank's share of the shape (ModelConfig.shard: its heads and intermediate
sizes, each expert's too); o_proj, down_proj and the experts end in an all-reduce, the
vocabulary is split over ranks.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.torch_sdpa import TorchSDPABackend
from engine.config import ModelConfig, RopeConfig
from engine.kv_quant import Scale
from engine.models.moe import SparseMoeBlock
from engine.models.parallel_layers import (
    VocabParallelEmbedding,
    gather_logits,
    make_embedding,
    vocab_shard,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType

    from engine.distributed import TPGroup


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: ModuleType | None = None  # engine.kernels when fused (set_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)[0]
        # Same arithmetic as transformers: normalise in float32, cast, then scale.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the decoder layer's add then norm."""
        if self.ops is not None:
            out, res = self.ops.rms_norm(x, self.weight, self.eps, residual)
            return out, res
        res = x + residual
        return self.forward(res), res


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                / head_dim))
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D] (rotate-half convention, as HF)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Rope:
    """One step's rotary embedding: cos/sin tensors (torch path), or the positions and
    the cos/sin cache the fused Triton kernel reads (in place)."""

    def __init__(self, positions: torch.Tensor, cos: torch.Tensor | None = None,
                 sin: torch.Tensor | None = None, cache: torch.Tensor | None = None,
                 ops: ModuleType | None = None) -> None:
        self.positions, self.cos, self.sin, self.cache, self.ops = (
            positions, cos, sin, cache, ops)

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ops is not None:
            self.ops.rotary_embedding(q, k, self.positions, self.cache)
            return q, k
        assert self.cos is not None and self.sin is not None
        return apply_rope(q, self.cos, self.sin), apply_rope(k, self.cos, self.sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5
        # A float8 KV cache's per-tensor scales: device scalars the engine owns
        # (engine.kv_scales); unused otherwise. `kv_calibrate`, set for the one forward
        # pass that computes them (--calculate-kv-scales), sees K and V first.
        self.k_scale: Scale = 1.0
        self.v_scale: Scale = 1.0
        self.kv_calibrate: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self.backend: AttentionBackend = TorchSDPABackend()

    def forward(self, x: torch.Tensor, rope: Rope, kv_layer: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k)
        if self.kv_calibrate is not None:
            self.kv_calibrate(k, v)
        o = self.backend.forward(q, k, v, kv_layer, meta, self.scale, self.k_scale,
                                 self.v_scale)
        out = self.o_proj(o.reshape(t, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.inter = inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.ops: ModuleType | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:
            out = self.down_proj(self.ops.silu_and_mul(gate_up))
        else:
            gate, up = gate_up.split(self.inter, dim=-1)
            out = self.down_proj(F.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


def moe_block(cfg: ModelConfig, tp: TPGroup | None = None) -> SparseMoeBlock:
    return SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                          cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob,
                          round_weights=cfg.model_type == "qwen3_moe", tp=tp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, tp)
        self.mlp: MLP | SparseMoeBlock = (
            moe_block(cfg, tp) if index in cfg.sparse_layers else MLP(cfg, tp=tp))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                kv_layer: torch.Tensor, meta: AttentionMetadata,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next
        layer (or the final norm) adds them, fused with its norm."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, rope, kv_layer, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """The embedding, the layers (`layer(cfg, index, tp)` each) and the final norm."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None,
                 layer: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = (
            make_embedding(cfg.vocab_size, cfg.hidden_size, tp))
        make = layer or DecoderLayer
        self.layers = nn.ModuleList(make(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:
            return self.norm(x)
        return self.norm.add_forward(x, residual)[0]


class CausalLM(nn.Module):
    """What every model here shares around its decoder: the LM head (vocab-parallel
    under TP, tied to the embedding when the config says so), the switch to the fused
    Triton kernels and the logits."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None, model: DecoderModel) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = model
        rows = cfg.vocab_size if tp is None else vocab_shard(cfg.vocab_size, tp.size)
        self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.ops: ModuleType | None = None

    def use_kernels(self, fused: bool, attention: type[nn.Module], backend: object) -> None:
        """Gives every `attention` module `backend` and, with `fused`, the norms and
        MLPs engine.kernels and the experts the fused MoE kernel."""
        ops: ModuleType | None = None
        if fused:
            import engine.kernels

            ops = engine.kernels
        self.ops = ops
        for m in self.modules():
            if isinstance(m, RMSNorm | MLP):
                m.ops = ops
            elif isinstance(m, attention):
                m.backend = backend  # type: ignore[assignment]
            elif isinstance(m, SparseMoeBlock):
                m.use_triton = fused

    def compute_logits(self, hidden: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits [n, vocab], into `out` if given (a CUDA graph's static buffer:
        the copy converts, no float32 temporary); under TP every rank calls it (a gather)."""
        if self.tp is not None:
            logits = gather_logits(hidden, self.lm_head.weight, self.config.vocab_size,
                                   self.tp)
        else:
            logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)


class LlamaForCausalLM(CausalLM):
    """Forward over a flat batch of tokens from many sequences (no padding). With `tp`,
    `cfg` is this rank's share of the shape (ModelConfig.shard)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__(cfg, tp, DecoderModel(cfg, tp))
        with torch.device("cpu"):  # not on meta (make_embedding says why); moved later
            inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.cos_sin_cache: torch.Tensor | None = None

    def set_kernels(self, backend: AttentionBackend, fused: bool, max_positions: int) -> None:
        """Chooses the attention backend and, with `fused`, the Triton elementwise
        kernels (engine.kernels: RMSNorm with residual add, rotary, SiLU*mul) and the
        fused MoE kernel (engine.fused_moe) for the experts."""
        self.use_kernels(fused, Attention, backend)
        if self.ops is not None:
            inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
            self.cos_sin_cache = self.ops.build_cos_sin_cache(inv_freq, max_positions)

    def rope_cos_sin(self, positions: torch.Tensor,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        freqs = positions.float().unsqueeze(1) * inv_freq.float().unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: the block-major cache. Returns hidden [T, H]."""
        x = self.model.embed_tokens(input_ids)
        if self.ops is not None and self.cos_sin_cache is not None:
            rope = Rope(positions, cache=self.cos_sin_cache, ops=self.ops)
        else:
            rope = Rope(positions, *self.rope_cos_sin(positions, x.dtype))
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, rope, kv_cache[:, i], meta)
        return self.model.final_norm(x, residual)
