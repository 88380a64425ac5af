"""`splitserve generate`: run the engine offline on one prompt and stream the text."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from engine.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    check_kv_cache_dtype,
)
from engine.default_model import RANDOM_WEIGHTS_NOTICE, ensure_default_model
from engine.model_shapes import MODEL_SHAPES, SHAPE_NOTICE, model_shape_dir

_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
               "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10,
               "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '2GB', '1e9' or a plain integer -> bytes (argparse type)."""
    s = text.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = s[len(num):].strip()
    try:
        value = float(num) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (e.g. 4GiB, 512MiB, 2GB, 1073741824)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return int(value)


def model_shape_arg(text: str) -> str:
    """A shipped shape's name or the path of a config.json file (argparse type)."""
    if text in MODEL_SHAPES or (text.endswith(".json") and os.path.isfile(text)):
        return text
    raise argparse.ArgumentTypeError(
        f"unknown model shape {text!r}; choose from {', '.join(MODEL_SHAPES)} "
        "or pass the path of a config.json file")


def add_parallel_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Tensor parallelism's flags (engine/distributed.py)."""
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N ranks (processes), on N GPUs on CUDA "
                        "(cuda:0..N-1 of the visible ones)")
    p.add_argument("--collective-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="a collective between ranks that takes longer ends the process: "
                        "a dead or hung rank takes the whole engine down, never a hang")


def check_parallel_args(args: argparse.Namespace) -> None:
    tp = getattr(args, "tensor_parallel_size", 1)
    if tp < 1:
        raise SystemExit(f"--tensor-parallel-size must be >= 1, got {tp}")
    if getattr(args, "collective_timeout", 60.0) <= 0:
        raise SystemExit("--collective-timeout must be positive")


def parallel_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's tensor-parallel fields from the flags (for commands that build
    an LLM themselves)."""
    check_parallel_args(args)
    return {"tensor_parallel_size": getattr(args, "tensor_parallel_size", 1),
            "collective_timeout_s": getattr(args, "collective_timeout", 60.0)}


def add_kv_cache_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", type=kv_cache_dtype_arg, default="auto",
                   metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
                   help="auto: the model's dtype; fp8 (= fp8_e4m3): float8 e4m3 KV with "
                        "per-tensor k/v scales from the checkpoint, else 1.0")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="with --kv-cache-dtype fp8: compute each layer's k/v scales from "
                        "the first request's K and V (max|K| / $K_SCALE_CONSTANT, default "
                        "200; max|V| / $V_SCALE_CONSTANT, default 100), then keep them")


def kv_scale_constants() -> tuple[float, float]:
    """vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT from the environment."""
    try:
        return (float(os.environ.get("K_SCALE_CONSTANT", "200")),
                float(os.environ.get("V_SCALE_CONSTANT", "100")))
    except ValueError as e:
        raise ValueError(f"K_SCALE_CONSTANT / V_SCALE_CONSTANT: {e}") from None


def cache_dtype_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """CacheConfig's KV dtype fields from the flags (and the environment)."""
    calculate = getattr(args, "calculate_kv_scales", False)
    return {"cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
            "calculate_kv_scales": calculate,
            "kv_scale_constants": kv_scale_constants() if calculate else (200.0, 100.0)}


def kv_cache_dtype_arg(value: str) -> str:
    try:
        check_kv_cache_dtype(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Flags every engine-running command shares."""
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", default=None,
                       help="Hugging Face model directory (default: the embedded random model)")
    which.add_argument("--model-shape", type=model_shape_arg, default=None,
                       metavar="{" + ",".join(MODEL_SHAPES) + "}",
                       help="a known model's config.json with the embedded tokenizer and no "
                            "weights (implies --load-format dummy); or a config.json path")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default=None,
                   help="auto: *.safetensors from the model directory; dummy: random weights "
                        "generated on the device from config.json alone (default: auto, "
                        "dummy with --model-shape)")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="auto: the model's own (config.json's torch_dtype) on CUDA, float32 "
                        "on CPU")
    p.add_argument("--device", default="auto",
                   help="auto: cuda when a GPU is visible, else cpu; or cpu, cuda, cuda:N")
    add_kv_cache_dtype_argument(p)
    p.add_argument("--attention-backend", choices=["torch", "triton"], default=None,
                   help="default: triton on CUDA, torch (SDPA, the reference) elsewhere")
    p.add_argument("--attention-tuning", choices=["auto", "off"], default="auto",
                   help="auto: on CUDA with the triton backend, time a few split-K decode "
                        "tile configurations per batch shape and prefill tiles per query "
                        "length at start-up (seconds, logged) and use the fastest; off: "
                        "the untuned tiles")
    add_parallel_arguments(p)
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly (no CUDA graphs)")
    p.add_argument("--max-graph-tokens", type=int, default=512,
                   help="CUDA: mixed and prefill steps of at most this many tokens replay "
                        "CUDA graphs captured per token-count bucket; larger ones run "
                        "eagerly (0: no graphs for them; decode-only steps keep theirs)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step n+1 while the device runs step n; sampled ids "
                        "reach the host one step later (outputs unchanged). Default: on "
                        "for CUDA, off on CPU (as vLLM)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: share of the GPU's memory the engine may use (weights, "
                        "activations, graphs and the KV pool)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES",
                   help="KV pool size, e.g. 4GiB (default: 512MiB on CPU; on CUDA what "
                        "--gpu-memory-utilization leaves); --num-blocks overrides")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="order of waiting requests: fcfs (arrival), priority (the request's "
                        "priority, lower first), vtc (fair share between tenants); "
                        "scheduling strategies apply under each")
    # Offload tiers (kvtransfer.tiers.config.tier_config_from_args reads these).
    p.add_argument("--host-cache-blocks", type=int, default=0,
                   help="KV blocks kept in host DRAM after the device (0: no host tier)")
    p.add_argument("--disk-cache-dir", default=None, help="directory of the disk KV tier")
    p.add_argument("--disk-cache-blocks", type=int, default=0,
                   help="KV blocks kept on disk (needs --disk-cache-dir)")
    p.add_argument("--disk-direct-io", choices=["auto", "on", "off"], default="auto",
                   help="O_DIRECT for the disk tier (auto: where the filesystem takes it)")
    p.add_argument("--lmcache-config", default=None,
                   help="LMCache YAML config: adds an LMCache tier (splitserve[lmcache])")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")


def resolve_model(model: str | None) -> str:
    if model:
        return model
    print(RANDOM_WEIGHTS_NOTICE, file=sys.stderr)
    return ensure_default_model()


def resolve_model_and_format(args: argparse.Namespace) -> tuple[str, str]:
    """(model directory, load format) from --model / --model-shape / --load-format.
    A model shape has no weights, so it implies dummy weights and refuses "auto"."""
    shape = getattr(args, "model_shape", None)
    load_format = getattr(args, "load_format", None)
    if shape is None:
        return resolve_model(args.model), load_format or "auto"
    if load_format == "auto":
        raise SystemExit(f"--model-shape {shape} has no weights; it runs only with "
                         "--load-format dummy")
    print(SHAPE_NOTICE.format(name=shape), file=sys.stderr)
    return model_shape_dir(shape), "dummy"


def resolve_device_and_dtype(args: argparse.Namespace) -> None:
    """Turns `--device auto` / `--dtype auto` into what they mean here, in `args` itself,
    so every later reader (the worker's transport choice) sees the device in use. On CPU
    auto is float32: the reference arithmetic, and CPUs run half-precision matmuls slowly."""
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = None if args.device.startswith("cuda") else "float32"


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    resolve_device_and_dtype(args)
    check_parallel_args(args)
    model_dir, load_format = resolve_model_and_format(args)
    return EngineConfig(
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        collective_timeout_s=getattr(args, "collective_timeout", 60.0),
        model_dir=model_dir, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, load_format=load_format,
        attention_backend=getattr(args, "attention_backend", None),
        attention_tuning=getattr(args, "attention_tuning", "auto"),
        enforce_eager=getattr(args, "enforce_eager", False),
        max_graph_tokens=getattr(args, "max_graph_tokens", 512),
        async_scheduling=getattr(args, "async_scheduling", None),
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks,
                          kv_cache_memory_bytes=getattr(args, "kv_cache_memory", None),
                          gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.9),
                          **cache_dtype_kwargs(args)),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  policy=getattr(args, "scheduling_policy", "fcfs")))


def run(args: argparse.Namespace) -> int:
    from engine.llm_engine import LLMEngine, RequestError
    from engine.sampling_params import RequestOutputKind, SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    tok = engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat \
        else tok.encode(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k or None, seed=args.seed,
                            stop=args.stop, ignore_eos=args.ignore_eos,
                            output_kind=RequestOutputKind.DELTA)
    try:
        engine.add_request("cli-0", ids, params)
    except RequestError as e:
        print(f"splitserve: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(args.prompt, end="", flush=True)
    final = None
    while engine.has_work():
        for out in engine.step():
            print(out.new_text, end="", flush=True)
            final = out if out.finished else final
    dt = time.perf_counter() - t0
    n = final.num_output_tokens if final else 0
    print(f"\n[{len(ids)} prompt tokens, {n} generated in {dt:.2f}s "
          f"({n / max(dt, 1e-9):.1f} tok/s), finish_reason={final and final.finish_reason}]",
          file=sys.stderr)
    return 0
