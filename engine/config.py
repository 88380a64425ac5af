"""Engine configuration: the model's shape (read from a Hugging Face config.json) and
the engine's knobs. Torch-free, so the gateway can read a model's limits.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

from engine.hf_config import (
    DeepseekRouting,
    MLAConfig,
    ModelDirError,
    RopeConfig,
    deepseek_moe_fields,
    mla_from_dict,
    moe_fields,
    rope_from_dict,
)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
DTYPES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
# vLLM's --kv-cache-dtype: auto keeps the model's dtype; fp8 is e4m3 (as vLLM on NVIDIA).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_KV_DTYPE = "float8_e4m3fn"  # the cache tensor's dtype name under fp8
SCHEDULING_POLICIES = ("fcfs", "priority", "vtc")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a decoder-only model of the Llama family, dense or with
    mixture-of-experts MLPs in `sparse_layers`."""

    model_type: str  # llama | mistral | qwen2 | qwen3 | qwen3_moe | mixtral | deepseek_v2/v3
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    num_experts: int = 0  # 0: dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's intermediate size
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    sparse_layers: tuple[int, ...] = ()  # layers whose MLP is the experts
    mla: MLAConfig | None = None  # DeepSeek: latent attention, latent KV cache
    routing: DeepseekRouting | None = None

    @property
    def kv_layout_name(self) -> str:
        return "mla_latent_v1" if self.mla is not None else "block_major_v1"

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(parts, heads, head size) of one token's cache entry in one layer: K and V
        per KV head, or (MLA) one entry of latent + rope key shared by every head."""
        if self.mla is not None:
            return 1, 1, self.mla.latent_dim
        return 2, self.num_kv_heads, self.head_dim

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelDirError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.sparse_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelDirError(f"num_experts_per_tok {self.num_experts_per_tok} must be in "
                                f"[1, num_experts {self.num_experts}]")
        if self.sparse_layers and self.moe_intermediate_size <= 0:
            raise ModelDirError("moe_intermediate_size must be positive")
        if self.dtype not in DTYPES:
            raise ModelDirError(f"unsupported dtype {self.dtype!r}; supported: {DTYPES}")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelDirError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        model_type = SUPPORTED_ARCHITECTURES[arch]
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in cfg]
        if missing:
            raise ModelDirError(f"config.json lacks required keys: {missing}")
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        window = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            window = None  # HF ignores sliding_window for Qwen unless use_sliding_window
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
        deepseek = model_type.startswith("deepseek")
        rope = rope_from_dict(cfg)
        if rope.rope_type == "yarn" and not deepseek:
            raise ModelDirError(f"yarn rope scaling is supported for DeepSeek models only, "
                                f"not {arch}")
        return cls(
            model_type=model_type,
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=(mla_from_dict(cfg).qk_rope_head_dim if deepseek else
                      int(cfg.get("head_dim") or cfg["hidden_size"] // heads)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=int(window) if window else None,
            dtype=dtype,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            mla=mla_from_dict(cfg) if deepseek else None,
            **(deepseek_moe_fields(cfg, model_type) if deepseek
               else moe_fields(model_type, cfg)),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str) -> ModelConfig:
        path = os.path.join(model_dir, "config.json")
        if not os.path.isdir(model_dir):
            raise ModelDirError(
                f"model directory {model_dir!r} does not exist: give a Hugging Face model "
                "directory (config.json, *.safetensors, tokenizer.json), or --model-shape "
                "NAME with --load-format dummy for random weights")
        if not os.path.isfile(path):
            raise ModelDirError(f"{model_dir!r} has no config.json")
        try:
            with open(path) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ModelDirError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise ModelDirError(f"{path} must hold a JSON object")
        gen = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gen) and cfg.get("eos_token_id") is None:
            with open(gen) as f:
                cfg["eos_token_id"] = json.load(f).get("eos_token_id")
        return cls.from_dict(cfg)

    def check_tensor_parallel(self, tp: int) -> None:
        """Raises ModelDirError unless the model splits evenly over `tp` ranks: query
        heads, the dense MLP's and each expert's intermediate size by tp; KV heads by
        tp, or tp by the KV heads when there are fewer (each KV head then replicated on
        tp / KV ranks). MLA has no KV heads to split: every rank holds the whole latent."""
        if tp <= 1:
            return
        kv = self.num_kv_heads
        problems = []
        if self.num_heads % tp:
            problems.append(f"{self.num_heads} attention heads")
        if self.intermediate_size % tp:
            problems.append(f"intermediate size {self.intermediate_size}")
        if self.sparse_layers and self.moe_intermediate_size % tp:
            problems.append(f"expert intermediate size {self.moe_intermediate_size}")
        if self.mla is None and ((kv % tp) if kv >= tp else (tp % kv)):
            problems.append(f"{kv} KV heads (a multiple or a divisor of the TP size)")
        if problems:
            raise ModelDirError(f"tensor parallel size {tp} does not divide the model's "
                                + ", ".join(problems))

    def shard(self, tp: int) -> ModelConfig:
        """This model's shape on one of `tp` ranks: its share of the query heads, KV
        heads (at least one: replicated when fewer than ranks), the dense and each
        expert's intermediate size (a DeepSeek model's shared experts follow the
        experts'). The vocabulary stays whole: the embedding and LM head shard it
        themselves; so does an MLA latent (replicated on every rank)."""
        if tp <= 1:
            return self
        self.check_tensor_parallel(tp)
        return replace(self, num_heads=self.num_heads // tp,
                       num_kv_heads=max(1, self.num_kv_heads // tp),
                       intermediate_size=self.intermediate_size // tp,
                       moe_intermediate_size=self.moe_intermediate_size // tp)


def stop_eos_ids(model_dir: str, config_eos: tuple[int, ...],
                 tokenizer_eos: int | None) -> tuple[int, ...]:
    """The ids that end generation as EOS, as vLLM v1 has them (sampling_params.py
    update_from_generation_config): the tokenizer's EOS first, then the generation
    config's list, which is generation_config.json's `eos_token_id` when the file
    exists (transformers' GenerationConfig.from_pretrained) and config.json's
    (`config_eos`) only when it does not."""
    path = os.path.join(model_dir, "generation_config.json")
    gen: tuple[int, ...] = config_eos
    if os.path.isfile(path):
        try:
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            raise ModelDirError(f"cannot read {path}: {e}") from e
        ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
        gen = tuple(int(t) for t in ids if isinstance(t, int) and not isinstance(t, bool))
    first = () if tokenizer_eos is None else (tokenizer_eos,)
    return tuple(dict.fromkeys(first + gen))


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_cache_memory_bytes, else free memory
    # None: 512 MiB on CPU; on CUDA what gpu_memory_utilization leaves after the
    # weights, a profiled forward pass of the largest batch and the CUDA graphs.
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # vLLM's flag: share of the GPU's memory we may use
    enable_prefix_caching: bool = True
    # vLLM's cache_dtype: "auto" (the model's dtype) or "fp8"/"fp8_e4m3" (float8 e4m3
    # with per-tensor k/v scales, engine.kv_quant).
    cache_dtype: str = "auto"
    # vLLM's --calculate-kv-scales: the first real forward pass computes each layer's
    # k/v scales, max|K| / k and max|V| / v for these constants (vLLM's environment
    # variables K_SCALE_CONSTANT and V_SCALE_CONSTANT), instead of the checkpoint's.
    calculate_kv_scales: bool = False
    kv_scale_constants: tuple[float, float] = (200.0, 100.0)

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.cache_dtype)
        if self.calculate_kv_scales and self.cache_dtype == "auto":
            raise ValueError("--calculate-kv-scales needs --kv-cache-dtype fp8 (the scales "
                             "quantize a float8 cache)")
        if not all(c > 0 for c in self.kv_scale_constants):
            raise ValueError(f"KV scale constants must be positive, got "
                             f"{self.kv_scale_constants} (K_SCALE_CONSTANT, V_SCALE_CONSTANT)")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")


def check_kv_cache_dtype(name: str) -> None:
    """ValueError (one line, naming what works) for a KV cache dtype not supported."""
    if name not in KV_CACHE_DTYPES:
        hint = " (fp8_e5m2 is not supported: fp8 is e4m3)" if "e5m2" in name else ""
        raise ValueError(f"unsupported kv cache dtype {name!r}{hint}; "
                         f"choose from {', '.join(KV_CACHE_DTYPES)}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # one of SCHEDULING_POLICIES
    # VTC's cost of a prompt token computed and of an output token generated (the
    # paper's w_p and w_q); a tenant's counter grows by cost / its strategy weight.
    vtc_input_cost: float = 1.0
    vtc_output_cost: float = 2.0

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}; "
                             f"choose from {SCHEDULING_POLICIES}")
        if self.vtc_input_cost < 0 or self.vtc_output_cost < 0:
            raise ValueError("vtc_input_cost and vtc_output_cost must be >= 0")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_dir: str
    model_id: str = ""  # served name; part of every block hash's extra key
    dtype: str | None = None  # None: the model's own
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0
    # None: "triton" on CUDA, "torch" (SDPA, the reference) elsewhere. The elementwise
    # kernels (RMSNorm, rotary, SiLU*mul) follow the same choice.
    attention_backend: str | None = None
    # auto: on CUDA with the triton backend, time a few split-K decode configurations
    # per batch shape and unified-kernel (prefill) tiles per query length at start-up
    # and use the fastest (engine.attention.tuning); off: the untuned configurations.
    attention_tuning: str = "auto"
    enforce_eager: bool = False  # CUDA: no CUDA graphs at all (every step eager)
    # Decode-only steps take the CUDA graphs' padded, fixed-address inputs even where
    # nothing is captured (CPU, enforce_eager): the graph path run eagerly, on every rank.
    padded_decode: bool = False
    # vLLM's max capture size for steps that are not decode-only: mixed and prefill
    # steps of at most this many tokens replay CUDA graphs captured per token-count
    # bucket (engine/mixed_graphs.py); larger ones run eagerly. 0: all of them eager.
    max_graph_tokens: int = 512
    # Mixed and prefill steps take the mixed graphs' padded, fixed-address inputs even
    # where nothing is captured (CPU, enforce_eager), as padded_decode does for decode.
    padded_mixed: bool = False
    load_format: str = "auto"  # auto: *.safetensors; dummy: random weights from config.json
    # Ranks the model is split over (engine/distributed.py); rank 0 runs the engine,
    # ranks 1..N-1 the model only, on the next devices.
    tensor_parallel_size: int = 1
    # Seconds a collective between ranks may take before the worker gives up whole.
    collective_timeout_s: float = 60.0
    # Rank 0 keeps a full-head staging copy of the KV pool for the KV hand-off (a
    # prefill or decode worker under tensor parallelism): the pool sized from free GPU
    # memory leaves room for it.
    kv_staging: bool = False
    # The host schedules and lays out step n+1 while the device runs step n, feeding
    # step n's sampled ids (kept on the device) as its inputs (engine/async_step.py).
    # None: on for CUDA, off on CPU, as vLLM (where CPU torch runs each step before the
    # host goes on, there is nothing to overlap).
    async_scheduling: bool | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {DTYPES}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError("max_model_len must be positive")
        if self.attention_backend not in (None, "torch", "triton"):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}; "
                             "choose from ('torch', 'triton')")
        if self.attention_tuning not in ("auto", "off"):
            raise ValueError(f"unknown attention tuning {self.attention_tuning!r}; "
                             "choose from ('auto', 'off')")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load format {self.load_format!r}; "
                             f"choose from {LOAD_FORMATS}")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.collective_timeout_s <= 0:
            raise ValueError("collective_timeout_s must be positive")
        if self.max_graph_tokens < 0:
            raise ValueError("max_graph_tokens must be >= 0 (0: no graphs for mixed steps)")

    @property
    def backend(self) -> str:
        """The attention backend in use (the default follows the device)."""
        if self.attention_backend is not None:
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "torch"

    @property
    def tunes_attention(self) -> bool:
        """Whether the model runner tunes the attention kernels at start-up."""
        return (self.attention_tuning == "auto" and self.backend == "triton"
                and self.device.startswith("cuda"))

    @property
    def schedules_async(self) -> bool:
        """Whether the engine runs async scheduling (`async_scheduling`, or the device's
        default)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.device.startswith("cuda")

    @property
    def fp8_kv(self) -> bool:
        return self.cache.cache_dtype != "auto"

    def kv_dtype_name(self, model_dtype: str) -> str:
        """The KV cache tensor's dtype name (a kvtransfer.layout dtype): the compute
        dtype, or float8_e4m3fn under --kv-cache-dtype fp8."""
        return FP8_KV_DTYPE if self.fp8_kv else (self.dtype or model_dtype)

    @property
    def graph_safe_backend(self) -> bool:
        """Whether the attention backend's forward may be captured in a CUDA graph: the
        Triton kernels launch on grids sized from host ints fixed per bucket and read
        every length from device tensors. The torch reference is not graph-safe: it
        loops over sequences with host-side lengths (a replay would keep the capture's),
        its KV write and the MoE loop it comes with synchronise with the host."""
        return self.backend == "triton"

    @property
    def use_cuda_graphs(self) -> bool:
        """Capture decode graphs (every tensor-parallel rank captures the same buckets
        and replays the one rank 0's step names): on CUDA, with a graph-safe backend."""
        return self.device.startswith("cuda") and not self.enforce_eager \
            and self.graph_safe_backend

    @property
    def use_mixed_graphs(self) -> bool:
        """Capture graphs for mixed and prefill steps too (MLA models' buckets attend
        in the latent space, engine.attention.triton_mla)."""
        return self.use_cuda_graphs and self.max_graph_tokens > 0
