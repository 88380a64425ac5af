"""Builds a model from a Hugging Face directory: config.json + *.safetensors (sharded
too), or from config.json alone with random weights (load_format "dummy").

Under tensor parallelism each rank reads only its slices of each tensor
(safetensors' get_slice; engine/models/parallel_layers.py says which), so no rank
holds the whole model in memory, not even on the host."""

from __future__ import annotations

import glob
import os
import re
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from engine.config import LOAD_FORMATS, ModelConfig, ModelDirError
from engine.kv_quant import is_kv_scale_key
from engine.models.deepseek import DeepseekForCausalLM, deepseek_rope
from engine.models.llama import LlamaForCausalLM, rope_inv_freq
from engine.models.parallel_layers import shard_range

if TYPE_CHECKING:
    from engine.distributed import TPGroup

CausalLM = LlamaForCausalLM | DeepseekForCausalLM

# HF name (regex) -> (our parameter name, shard index within the fused parameter).
_FUSED_QKV = [
    (re.compile(r"(.*)\.self_attn\.q_proj\.(weight|bias)$"), r"\1.self_attn.qkv_proj.\2", 0),
    (re.compile(r"(.*)\.self_attn\.k_proj\.(weight|bias)$"), r"\1.self_attn.qkv_proj.\2", 1),
    (re.compile(r"(.*)\.self_attn\.v_proj\.(weight|bias)$"), r"\1.self_attn.qkv_proj.\2", 2),
]
_FUSED_MLP = [
    (re.compile(r"(.*)\.mlp\.gate_proj\.weight$"), r"\1.mlp.gate_up_proj.weight", 0),
    (re.compile(r"(.*)\.mlp\.up_proj\.weight$"), r"\1.mlp.gate_up_proj.weight", 1),
    (re.compile(r"(.*)\.mlp\.shared_experts\.gate_proj\.weight$"),
     r"\1.mlp.shared_experts.gate_up_proj.weight", 0),
    (re.compile(r"(.*)\.mlp\.shared_experts\.up_proj\.weight$"),
     r"\1.mlp.shared_experts.gate_up_proj.weight", 1),
]
# Per-expert HF weights, stacked into SparseMoeBlock's w13 [E, 2*I, H] (gate rows, then up
# rows) and w2 [E, H, I]. Qwen3-MoE and DeepSeek name them as the dense MLP; Mixtral
# w1 / w3 / w2 under block_sparse_moe (its gate too).
_EXPERT = re.compile(
    r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
    r"\.weight$")
_EXPERT_SLOT = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 0, "w2": 0}
_MIXTRAL_GATE = re.compile(r"(.*)\.block_sparse_moe\.gate\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _num_shards(cfg: ModelConfig, name: str, param: torch.Tensor) -> int:
    """How many HF tensors fill our parameter `name`."""
    if "qkv_proj" in name:
        return 3
    if "gate_up_proj" in name:
        return 2
    if name.endswith(".mlp.w13"):
        return 2 * param.shape[0]
    if name.endswith(".mlp.w2"):
        return param.shape[0]
    return 1


def _shard_view(param: torch.Tensor, cfg: ModelConfig, name: str,
                shard: int) -> torch.Tensor:
    """The part of `param` that HF tensor number `shard` fills."""
    if "qkv_proj" in name:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = [q, kv, kv]
        return param.narrow(0, sum(sizes[:shard]), sizes[shard])
    if "gate_up_proj" in name:
        half = param.shape[0] // 2
        return param.narrow(0, shard * half, half)
    if name.endswith(".mlp.w13"):
        expert, part = divmod(shard, 2)
        half = param.shape[1] // 2
        return param[expert].narrow(0, part * half, half)
    if name.endswith(".mlp.w2"):
        return param[shard]
    return param


def safetensors_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ModelDirError(f"{model_dir!r} has no *.safetensors weight files "
                            "(--load-format dummy runs it with random weights)")
    return files


def load_model(model_dir: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", seed: int = 0,
               tp: TPGroup | None = None) -> CausalLM:
    """Returns the model in eval mode on `device`. load_format "auto" loads every
    parameter from the directory's *.safetensors (raises ModelDirError naming missing
    or unexpected tensors); "dummy" needs only the config and fills the parameters with
    random values generated on the device (deterministic for a seed; each TP rank
    fills its own shard from seed + rank, and the tensors every rank holds whole, as
    routers and MLA's latent projections, from seed alone, so every rank routes alike).
    `cfg` is the full model's shape; with `tp` the model holds this rank's shard of it."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose from {LOAD_FORMATS}")
    model = _empty_model(cfg, dtype, device, tp)
    if load_format == "dummy":
        if tp is None:
            init_dummy_weights(model, seed)
        else:
            init_dummy_weights(model, seed + tp.rank, whole=_whole_matrices(model, cfg),
                               whole_seed=seed)
    else:
        _load_safetensors(model, model_dir, cfg, tp)
    return model.eval()


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 tp: TPGroup | None = None) -> CausalLM:
    """The model with uninitialised parameters on the device, allocated once in `dtype`
    (casting on the meta device first avoids a float32 copy of every weight)."""
    model: CausalLM
    with torch.device("meta"):
        rank_cfg = cfg.shard(tp.size) if tp else cfg
        model = (DeepseekForCausalLM(rank_cfg, tp) if cfg.mla is not None
                 else LlamaForCausalLM(rank_cfg, tp)).to(dtype)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty gives each module its own tensor: re-tie
        model.lm_head.weight = model.model.embed_tokens.weight
    if cfg.mla is not None:
        model.inv_freq = deepseek_rope(cfg)[0].to(device)
    else:
        model.inv_freq = rope_inv_freq(cfg.rope, cfg.head_dim).to(device)
    return model


def _whole_matrices(model: CausalLM, cfg: ModelConfig) -> set[str]:
    """The matrices of a rank's `model` that have the full model's shape: every rank
    holds them whole (routers, MLA's q_a / kv_a projections)."""
    with torch.device("meta"):
        full = DeepseekForCausalLM(cfg) if cfg.mla is not None else LlamaForCausalLM(cfg)
    shapes = {n: p.shape for n, p in full.named_parameters()}
    return {n for n, p in model.named_parameters() if p.dim() >= 2 and shapes.get(n) == p.shape}


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02,
                       whole: set[str] | frozenset[str] = frozenset(),
                       whole_seed: int = 0) -> None:
    """vLLM's dummy format: one fill per tensor, on the tensor's own device (no host
    round trip): N(0, std) for matrices, ones for norm scales, zeros for biases.
    Tied tensors are filled once (named_parameters yields a shared tensor once). The
    matrices named in `whole` are filled first, in order, from `whole_seed`: under TP
    each rank passes the same names and seed, so they come out the same on every rank."""
    gens: dict[torch.device, torch.Generator] = {}
    whole_gens: dict[torch.device, torch.Generator] = {}
    params = list(model.named_parameters())
    for name, p in params:
        if name in whole:
            p.normal_(0.0, std,
                      generator=None if p.is_meta else _generator(whole_gens, p, whole_seed))
    for name, p in params:
        if name in whole:
            continue
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=None if p.is_meta else _generator(gens, p, seed))
        elif name.endswith("bias"):
            p.zero_()
        else:  # 1-D scales: RMSNorm weights (layer norms, final norm, q/k norms)
            p.fill_(1.0)


def _generator(gens: dict[torch.device, torch.Generator], p: torch.Tensor,
               seed: int) -> torch.Generator:
    g = gens.get(p.device)
    if g is None:
        g = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
    return g


def _load_safetensors(model: CausalLM, model_dir: str, cfg: ModelConfig,
                      tp: TPGroup | None = None) -> None:
    full = cfg
    cfg = model.config  # this rank's shape: the fused shards' sizes
    params = dict(model.named_parameters())
    if cfg.tie_word_embeddings:
        params.pop("lm_head.weight", None)  # shares embed_tokens' tensor
    loaded: set[tuple[str, int]] = set()
    expected = {(n, i) for n, p in params.items() for i in range(_num_shards(cfg, n, p))}
    unexpected = []
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if "rotary_emb" in key or is_kv_scale_key(key):
                    continue  # (KV scales: engine.kv_quant reads them)
                if cfg.tie_word_embeddings and key == "lm_head.weight":
                    continue
                layer = _LAYER.match(key)
                if layer and int(layer.group(1)) >= cfg.num_layers:
                    continue  # DeepSeek-V3's multi-token-prediction layer: not run
                target, shard = _map_name(key, cfg)
                param = params.get(target)
                if param is None or shard >= _num_shards(cfg, target, param):  # a 9th expert
                    unexpected.append(key)
                    continue
                _copy_in(param, _read(f, key, full, tp), cfg, target, shard, tp is not None)
                loaded.add((target, shard))
    missing = sorted({n for n, _ in expected - loaded})
    if missing:
        raise ModelDirError(f"weights missing from {model_dir!r}: {missing[:8]}")
    if unexpected:
        raise ModelDirError(f"unexpected tensors in {model_dir!r}: {unexpected[:8]}")


def _read(f: object, key: str, cfg: ModelConfig, tp: TPGroup | None) -> torch.Tensor:
    """The tensor `key`, or under TP only this rank's rows / columns of it."""
    part = shard_range(cfg, key, tp.rank, tp.size) if tp is not None else None
    if part is None:
        return f.get_tensor(key)  # type: ignore[attr-defined]
    dim, start, end = part
    sl = f.get_slice(key)  # type: ignore[attr-defined]
    return sl[start:end] if dim == 0 else sl[:, start:end]


def _map_name(key: str, cfg: ModelConfig) -> tuple[str, int]:
    """(our parameter, shard): the shard of an expert weight is 2 * expert + (0 gate,
    1 up) in w13, the expert in w2."""
    m = _EXPERT.match(key)
    if m is not None:
        expert, which = int(m.group(2)), m.group(3)
        if which in ("down_proj", "w2"):
            return f"{m.group(1)}.mlp.w2", expert
        return f"{m.group(1)}.mlp.w13", 2 * expert + _EXPERT_SLOT[which]
    if _MIXTRAL_GATE.match(key):
        return _MIXTRAL_GATE.sub(r"\1.mlp.gate.weight", key), 0
    # MLA keeps its q projection(s) apart: only Llama-family attention fuses q, k, v.
    for pattern, repl, shard in (_FUSED_MLP if cfg.mla else _FUSED_QKV + _FUSED_MLP):
        if pattern.match(key):
            return pattern.sub(repl, key), shard
    return key, 0


def _copy_in(param: torch.nn.Parameter, tensor: torch.Tensor, cfg: ModelConfig,
             name: str, shard: int, vocab_sharded: bool = False) -> None:
    with torch.no_grad():
        dst = _shard_view(param, cfg, name, shard)
        if vocab_sharded and ("embed_tokens" in name or "lm_head" in name) \
                and tensor.shape[0] < dst.shape[0]:
            # the last TP rank's vocab shard: rows past the vocabulary stay zero
            dst[tensor.shape[0]:].zero_()
            dst = dst.narrow(0, 0, tensor.shape[0])
        if dst.shape != tensor.shape:
            raise ModelDirError(
                f"tensor {name} (shard {shard}) has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(dst.shape)}")
        dst.copy_(tensor)
