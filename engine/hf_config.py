"""The architecture-specific parts of a Hugging Face config.json: rope scaling, DeepSeek's
latent attention and routing, the experts' fields. engine.config builds ModelConfig from
them. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ModelDirError(ValueError):
    """The model directory is missing something or holds something we cannot run."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (DeepSeek): the ramp between interpolated and extrapolated frequencies, and
    # the mscales behind the cos/sin factor and the softmax scale.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ModelDirError(
                f"unsupported rope scaling type {self.rope_type!r}; supported: {ROPE_TYPES}")


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: queries through an optional low-rank
    (q_lora_rank), keys and values from one latent of kv_lora_rank per token plus a
    shared rope key of qk_rope_head_dim. The KV cache holds only latent + rope key."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rope over (even, odd) pairs, as DeepSeek's weights

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the cache: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class DeepseekRouting:
    """DeepSeek's routing beyond ModelConfig's expert fields: the score function,
    group-limited selection, the scaling of the routed sum, the shared experts."""

    scoring: str = "softmax"  # softmax (V2) | sigmoid (V3, with e_score_correction_bias)
    n_group: int | None = None  # None: plain top-k
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0

    @property
    def correction_bias(self) -> bool:
        return self.scoring == "sigmoid"


def moe_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The experts' fields: Mixtral's in every layer (renormalised top-k); Qwen3-MoE's in
    the layers that decoder_sparse_step picks, less mlp_only_layers (as transformers)."""
    if model_type not in ("qwen3_moe", "mixtral"):
        return {}
    layers = int(cfg["num_hidden_layers"])
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if model_type == "mixtral":
        sparse = tuple(range(layers))
        inter, norm = int(cfg["intermediate_size"]), True
    else:
        step = int(cfg.get("decoder_sparse_step", 1))
        if step <= 0:
            raise ModelDirError("decoder_sparse_step must be positive")
        only = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(layers)
                       if experts > 0 and i not in only and (i + 1) % step == 0)
        inter = int(cfg.get("moe_intermediate_size") or 0)
        norm = bool(cfg.get("norm_topk_prob", False))
    return dict(num_experts=experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
                moe_intermediate_size=inter, norm_topk_prob=norm, sparse_layers=sparse)


def rope_from_dict(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older configs
    # write `rope_theta` and `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", 8192)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=_opt_float(params.get("mscale")),
        mscale_all_dim=_opt_float(params.get("mscale_all_dim")),
        attention_factor=_opt_float(params.get("attention_factor")),
        truncate=bool(params.get("truncate", True)),
    )


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def mla_from_dict(cfg: dict[str, Any]) -> MLAConfig:
    missing = [k for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                           "v_head_dim") if cfg.get(k) is None]
    if missing:
        raise ModelDirError(f"config.json lacks the MLA keys {missing}")
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        # DeepSeek-V2's complex rotary is the interleaved rotation; V3 says which.
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


def deepseek_moe_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """transformers' DeepSeek MoE: experts in the layers from first_k_dense_replace on.
    V2 routes by softmax, top-k greedy or group-limited (a group ranks by its best
    expert), never renormalised; V3 by sigmoid with the correction bias, groups ranked
    by their two best, renormalised when norm_topk_prob."""
    experts = int(cfg.get("n_routed_experts") or 0)
    if not experts:
        return {}
    v3 = model_type == "deepseek_v3"
    group_limited = v3 or cfg.get("topk_method") == "group_limited_greedy"
    n_group = int(cfg.get("n_group") or 1) if group_limited else None
    if n_group is not None and experts % n_group:
        raise ModelDirError(f"{experts} experts do not split into n_group {n_group} groups")
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 1),
        moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) if v3 else False,
        sparse_layers=tuple(range(first_dense, int(cfg["num_hidden_layers"]))),
        routing=DeepseekRouting(
            scoring="sigmoid" if v3 else "softmax", n_group=n_group,
            topk_group=int(cfg.get("topk_group") or 1) if group_limited else None,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0)),
    )
