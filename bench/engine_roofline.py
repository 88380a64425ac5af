"""The machine's limits, measured in the benchmark's own run, and a model's cost per
engine step: the roofline `bench engine --model-shape` holds our step times against.

A step's roofline time is max(bytes / bandwidth, FLOPs / matmul peak): decode steps are
bound by reading the weights and the KV cache, prefill steps by the matmuls. A
mixture-of-experts step reads only the experts its tokens are routed to: the expected
number of distinct experts for a step's tokens under uniform routing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from engine.config import ModelConfig

if TYPE_CHECKING:  # torch loads where limits are measured: ModelCost runs without it
    import torch


@dataclass(frozen=True, slots=True)
class MachineLimits:
    device: str
    bandwidth_bytes_s: float
    bandwidth_method: str
    matmul_flop_s: float
    matmul_method: str

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "bandwidth_GB_s": self.bandwidth_bytes_s / 1e9,
                "matmul_TFLOP_s": self.matmul_flop_s / 1e12}


def measure_limits(device: torch.device, dtype: torch.dtype) -> MachineLimits:
    """HBM bandwidth and matmul throughput on CUDA (device-to-device copy, a GEMM in
    `dtype`); on CPU a memcpy and a float32 GEMM, labelled so (a smoke-test stand-in)."""
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        copy_bytes, n = 2 << 30, 8192
        bw = _best_seconds(device, lambda: _copy(device, copy_bytes), reps=20)
        mm = _best_seconds(device, lambda: _gemm(device, n, dtype), reps=10)
        return MachineLimits(
            name, 2 * copy_bytes / bw, "device-to-device copy of 2 GiB, bytes read + "
            "written / time (best of 20, CUDA events)",
            2 * n**3 / mm, f"{_short(dtype)} GEMM {n}x{n}x{n} (best of 10, CUDA events)")
    copy_bytes, n = 128 << 20, 1024
    bw = _best_seconds(device, lambda: _copy(device, copy_bytes), reps=5)
    mm = _best_seconds(device, lambda: _gemm(device, n, torch.float32), reps=5)
    return MachineLimits(
        f"cpu ({torch.get_num_threads()} threads)", 2 * copy_bytes / bw,
        "CPU memcpy of 128 MiB, bytes read + written / time (best of 5)",
        2 * n**3 / mm, f"CPU float32 GEMM {n}x{n}x{n} (best of 5)")


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _copy(device: torch.device, nbytes: int) -> tuple[Any, Any]:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), (src, dst)


def _gemm(device: torch.device, n: int, dtype: torch.dtype) -> tuple[Any, Any]:
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return (lambda: torch.mm(a, b, out=out)), (a, b, out)


def _best_seconds(device: torch.device, setup: Any, reps: int) -> float:
    """Best time of `reps` runs of the op `setup()` returns, after one warm-up run
    (the best, not the mean: a limit is what the machine can do, not what it did)."""
    import torch

    op, keep = setup()
    op()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            import time

            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
    del keep
    return min(times)


@dataclass(frozen=True, slots=True)
class ModelCost:
    """Bytes and FLOPs of one engine step of a model, counted from its config."""

    layer_params: int  # all decoder layers, as one token sees them (top_k experts each)
    head_params: int  # lm_head (the embedding matrix when tied): read every step
    embed_params: int  # rows are gathered, not streamed: no roofline bytes
    norm_params: int  # the final norm
    itemsize: int
    kv_bytes_per_token: int  # all layers, K and V
    attn_flops_per_pair: int  # one query token attending one key, all layers
    expert_params: int = 0  # one expert's weights summed over the sparse layers
    num_experts: int = 0  # per sparse layer; 0: dense
    top_k: int = 0

    @classmethod
    def from_config(cls, cfg: ModelConfig, itemsize: int,
                    kv_itemsize: int | None = None) -> ModelCost:
        """`kv_itemsize`: the KV cache's bytes a value when not the weights' (1 for an
        FP8 cache)."""
        h, d = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv if cfg.qkv_bias else 0)
        norms = 2 * h + (2 * d if cfg.qk_norm else 0)
        kv_bytes = cfg.num_layers * 2 * kv * (kv_itemsize or itemsize)
        attn_flops = cfg.num_layers * 4 * cfg.num_heads * d
        if cfg.mla is not None:
            attn, norms, kv_bytes, attn_flops = _mla_costs(cfg, itemsize)
        sparse = len(cfg.sparse_layers)
        expert = 3 * h * cfg.moe_intermediate_size
        shared = 0 if cfg.routing is None else cfg.routing.n_shared_experts * expert
        # A sparse layer: the router, then top_k of its experts per token (and any
        # shared experts, which every token runs).
        moe_mlp = h * cfg.num_experts + cfg.num_experts_per_tok * expert + shared
        mlps = (cfg.num_layers - sparse) * 3 * h * cfg.intermediate_size + sparse * moe_mlp
        vocab = cfg.vocab_size * h
        return cls(layer_params=cfg.num_layers * (attn + norms) + mlps, head_params=vocab,
                   embed_params=0 if cfg.tie_word_embeddings else vocab, norm_params=h,
                   itemsize=itemsize,
                   kv_bytes_per_token=kv_bytes,
                   # QK^T and PV: 2 FLOPs per multiply-add each, per head and dim
                   attn_flops_per_pair=attn_flops,
                   expert_params=sparse * expert,
                   num_experts=cfg.num_experts if sparse else 0,
                   top_k=cfg.num_experts_per_tok if sparse else 0)

    @property
    def params(self) -> int:
        idle = (self.num_experts - self.top_k) * self.expert_params
        return (self.layer_params + idle + self.head_params + self.embed_params
                + self.norm_params)

    @property
    def weight_bytes(self) -> int:
        """Weights a step streams when every expert is hit (any step of a dense model):
        layers, final norm, lm_head."""
        return self.weight_bytes_for(None)

    def active_experts(self, tokens: int) -> float:
        """Expected distinct experts per sparse layer that `tokens` tokens, each routed to
        top_k distinct experts uniformly, reach: E * (1 - (1 - k/E)^tokens)."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** tokens)

    def weight_bytes_for(self, tokens: int | None) -> int:
        """Weights a step of `tokens` tokens streams (None: every expert)."""
        experts = self.num_experts if tokens is None else self.active_experts(tokens)
        layers = self.layer_params + (experts - self.top_k) * self.expert_params
        return round((layers + self.norm_params + self.head_params) * self.itemsize)

    def step_bytes(self, kv_tokens_read: int, tokens: int | None = None) -> int:
        """Weights (the experts `tokens` reach; None: all) plus the KV the step reads."""
        return self.weight_bytes_for(tokens) + kv_tokens_read * self.kv_bytes_per_token

    def step_flops(self, tokens: int, sampled: int, attn_pairs: int) -> int:
        """Matmul FLOPs: 2 * params per token through the layers, the lm_head only for
        the rows that are sampled, and causal attention over `attn_pairs` (query, key)."""
        return (2 * self.layer_params * tokens + 2 * self.head_params * sampled
                + self.attn_flops_per_pair * attn_pairs)


def _mla_costs(cfg: ModelConfig, itemsize: int) -> tuple[int, int, int, int]:
    """MLA's (attention params, norm params, KV bytes per token, attention FLOPs per
    (query, key) pair) per its config: the cache holds latent + rope key per layer, and
    decode attends in the latent space (score over rank + rope, output over rank)."""
    m = cfg.mla
    assert m is not None
    h, heads = cfg.hidden_size, cfg.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = h * heads * qk if m.q_lora_rank is None else (
        h * m.q_lora_rank + m.q_lora_rank * heads * qk)
    attn = (q + h * m.latent_dim + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
            + heads * m.v_head_dim * h)
    if cfg.qkv_bias:
        attn += (m.q_lora_rank or 0) + m.latent_dim + h
    norms = 2 * h + m.kv_lora_rank + (m.q_lora_rank or 0)
    flops = cfg.num_layers * heads * (2 * m.latent_dim + 2 * m.kv_lora_rank)
    return attn, norms, cfg.num_layers * m.latent_dim * itemsize, flops


def causal_pairs(start: int, end: int) -> int:
    """(query, key) pairs of positions start..end-1 attending causally to 0..p:
    sum of (p + 1) over p in [start, end)."""
    return (end * (end + 1) - start * (start + 1)) // 2


@dataclass(slots=True)
class StepRecord:
    """One engine step as the benchmark saw it: its time and what it computed."""

    seconds: float
    tokens: int
    sampled: int
    attn_pairs: int
    kv_tokens_read: int
    decode_only: bool


def step_summary(steps: list[StepRecord], cost: ModelCost, limits: MachineLimits,
                 decode_only: bool | None) -> dict[str, Any] | None:
    """Measured step time against the roofline over the decode-only steps (True), the
    other steps (False) or all (None). Memory roofline: weights + the KV read at each
    step's context lengths over the bandwidth; compute roofline: the step's matmul
    FLOPs over the GEMM peak; roofline: the larger of the two, step by step."""
    chosen = [s for s in steps if decode_only is None or s.decode_only == decode_only]
    if not chosen:
        return None
    measured = sum(s.seconds for s in chosen)
    mem = [cost.step_bytes(s.kv_tokens_read, s.tokens) / limits.bandwidth_bytes_s
           for s in chosen]
    comp = [cost.step_flops(s.tokens, s.sampled, s.attn_pairs) / limits.matmul_flop_s
            for s in chosen]
    both = sum(max(m, c) for m, c in zip(mem, comp, strict=True))
    k = len(chosen)
    return {"steps": k, "tokens": sum(s.tokens for s in chosen),
            "mean_ms": measured / k * 1e3, "memory_roofline_ms": sum(mem) / k * 1e3,
            "compute_roofline_ms": sum(comp) / k * 1e3, "roofline_ms": both / k * 1e3,
            "memory_frac": sum(mem) / measured, "compute_frac": sum(comp) / measured,
            "roofline_frac": both / measured}


def roofline_label(phase: str, key: str) -> str:
    """'decode steps, memory roofline'; c's is every step's, memory or compute
    (whichever bounds the step)."""
    if phase == "all_steps":
        return "all steps, each at its memory or compute bound"
    return f"{phase} steps, {key.removesuffix('_frac')} roofline"
