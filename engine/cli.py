"""`splitserve generate`: run the engine offline on one prompt and stream the text."""

from __future__ import annotations

import argparse
import sys
import time

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.default_model import RANDOM_WEIGHTS_NOTICE, ensure_default_model


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Flags every engine-running command shares."""
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory (default: the embedded random model)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
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


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:

    return EngineConfig(
        model_dir=resolve_model(args.model), dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens))


def run(args: argparse.Namespace) -> int:
    from engine.llm_engine import LLMEngine, RequestError
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    tok = engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat \
        else tok.encode(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k or None, seed=args.seed,
                            stop=args.stop, ignore_eos=args.ignore_eos)
    try:
        engine.add_request("cli-0", ids, params)
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(args.prompt, end="", flush=True)
    final = None
    while engine.has_work():
        for out in engine.step():
            print(out.new_text, end="", flush=True)
            final = out if out.finished else final
    dt = time.perf_counter() - t0
    n = len(final.token_ids) if final else 0
    print(f"\n[{len(ids)} prompt tokens, {n} generated in {dt:.2f}s "
          f"({n / max(dt, 1e-9):.1f} tok/s), finish_reason={final and final.finish_reason}]",
          file=sys.stderr)
    return 0
