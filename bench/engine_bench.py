"""`splitserve bench engine`: our engine's output tokens/s against transformers' batched
`generate` on the same random-weight model and prompts, in one process run.

transformers pads the batch to its longest prompt and keeps generating until the
longest output is done; we count for both only the tokens each request asked for.

With --device or --model-shape it runs bench.engine_shape_bench instead: a known model
shape with random weights on one device, four workloads, and the roofline measured in
the same run. Without them: the CPU figure below on a small random Llama.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from typing import Any

from engine.cli import (
    add_kv_cache_dtype_argument,
    add_parallel_arguments,
    cache_dtype_kwargs,
    parallel_kwargs,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[128, 512], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[64, 128], metavar=("MIN", "MAX"))
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hf-batch-size", type=int, default=0,
                   help="0: all prompts in one batch (shape bench: up to 64 per batch)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default 2048 (shape bench: 16384 on CUDA, and at least workload "
                        "d's prompt)")
    p.add_argument("--seed", type=int, default=0)
    add_kv_cache_dtype_argument(p)
    add_parallel_arguments(p)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="our engine schedules step n+1 while step n runs (engine flag)")
    p.add_argument("--json", default=None, help="write results here")
    add_shape_arguments(p)


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The model-shape benchmark's flags (bench.engine_shape_bench)."""
    from engine.cli import model_shape_arg
    from engine.model_shapes import MODEL_SHAPES

    g = p.add_argument_group("model-shape benchmark (with --device or --model-shape)")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    g.add_argument("--model-shape", type=model_shape_arg, default=None,
                   metavar="{" + ",".join(MODEL_SHAPES) + "}",
                   help="known shape (random weights, load format dummy), or a config.json")
    g.add_argument("--workloads", default="a,b,c,d",
                   help="subset of a (1x 512+256), b (64x 512+128), c (nano-vllm's 256 "
                        "requests), d (8k prefill), e (16x 7168+128: decode over long "
                        "contexts, for sim calibrate)")
    g.add_argument("--scale", type=float, default=1.0,
                   help="multiply request counts and lengths (smoke runs)")
    g.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--attention-backend", choices=["torch", "triton"], default=None)
    g.add_argument("--attention-tuning", choices=["auto", "off"], default="auto",
                   help="start-up tuning of split-K decode's and prefill's tiles "
                        "(CUDA, triton)")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--max-graph-tokens", type=int, default=512,
                   help="CUDA graphs for mixed and prefill steps up to this many tokens "
                        "(engine flag; 0: those steps eager)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)


def build_model(root: str, hidden: int, layers: int,
                vocab_size: int | None = None) -> tuple[str, int]:
    """Writes a random Llama with the default tokenizer (widened to `vocab_size` entries
    when given: `widen_tokenizer`); returns (dir, vocab size)."""
    from engine.default_model import llama_config, write_random_weights, write_tokenizer

    vocab = write_tokenizer(root)
    if vocab_size is not None:
        vocab = widen_tokenizer(root, vocab_size)
    heads = max(1, hidden // 64)
    cfg = llama_config(vocab, 0, [4], hidden_size=hidden, intermediate_size=hidden * 3,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=max(1, heads // 2), head_dim=64)
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_random_weights(root, cfg)
    return root, vocab


def widen_tokenizer(model_dir: str, vocab_size: int, seed: int = 0) -> int:
    """Grows the tokenizer.json in `model_dir` to `vocab_size` entries (e.g. Llama 3's
    128256) with random byte-level words: lowercase letters, one in two after a space, one
    in ten ending in a 2- to 4-byte character. Work that depends on the vocabulary's size
    (decoding: its lookups, the pieces a detokenizer remembers) then costs what it does
    on a real model; encoding never produces the new words (they have no merges).
    Returns the vocabulary size."""
    from tokenizers import pre_tokenizers

    path = os.path.join(model_dir, "tokenizer.json")
    with open(path) as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    rng = random.Random(seed)
    wide = "éß中文日本語한국어😀🚀"
    while len(vocab) < vocab_size:
        word = " " * (rng.random() < 0.5) + "".join(
            rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
        if rng.random() < 0.1:
            word += rng.choice(wide)
        vocab.setdefault(to_bytes.pre_tokenize_str(word)[0][0], len(vocab))
    with open(path, "w") as f:
        json.dump(spec, f)
    return len(vocab)


def run_ours(model_dir: str, prompts: list[list[int]], out_lens: list[int],
             max_batched: int, cache_dtype: str = "auto", **parallel: Any) -> float:
    """`parallel`: tensor_parallel_size / collective_timeout_s (and async_scheduling)
    for the engine."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    total = sum(len(p) + o for p, o in zip(prompts, out_lens, strict=True))
    llm = LLM(model_dir, dtype="float32", block_size=16, num_blocks=total // 16 + 2 * len(prompts),
              max_num_seqs=len(prompts), max_num_batched_tokens=max_batched,
              cache_dtype=cache_dtype, **parallel)
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in out_lens]
    llm.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert sum(len(o.token_ids) for o in outs) == sum(out_lens)
    return dt


def run_hf(model_dir: str, prompts: list[list[int]], out_lens: list[int],
           batch_size: int) -> float:
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = 1
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i:i + batch_size], out_lens[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                           min_new_tokens=max(lens), do_sample=False, pad_token_id=pad)
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    if args.device is not None or args.model_shape is not None:
        from bench.engine_shape_bench import run as run_shapes

        return run_shapes(args)
    import torch

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as root:
        model_dir, vocab = build_model(root, args.hidden_size, args.num_layers)
        prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(*args.input_len))]
                   for _ in range(args.num_prompts)]
        out_lens = [rng.randint(*args.output_len) for _ in range(args.num_prompts)]
        n_out = sum(out_lens)
        kv = cache_dtype_kwargs(args)
        ours = run_ours(model_dir, prompts, out_lens, args.max_num_batched_tokens or 2048,
                        kv.pop("cache_dtype"), async_scheduling=args.async_scheduling,
                        **kv, **parallel_kwargs(args))
        hf = run_hf(model_dir, prompts, out_lens, args.hf_batch_size or len(prompts))
    result: dict[str, Any] = {
        "summary": {"splitserve_tok_s": n_out / ours, "hf_tok_s": n_out / hf,
                    "ratio": hf / ours},
        "config": {**{k: v for k, v in vars(args).items() if not k.startswith("_")},
                   "torch_threads": torch.get_num_threads(), "output_tokens": n_out,
                   "input_tokens": sum(map(len, prompts))},
        "seconds": {"splitserve": ours, "hf": hf},
    }
    s = result["summary"]
    print(f"model: random Llama, {args.num_layers} layers, hidden {args.hidden_size}; "
          f"{args.num_prompts} prompts of {args.input_len[0]}-{args.input_len[1]} tokens, "
          f"{args.output_len[0]}-{args.output_len[1]} output tokens each ({n_out} in all)")
    print(f"{'engine':<28}{'seconds':>10}{'output tok/s':>16}")
    print(f"{'splitserve':<28}{ours:>10.2f}{s['splitserve_tok_s']:>16.1f}")
    print(f"{'transformers generate':<28}{hf:>10.2f}{s['hf_tok_s']:>16.1f}")
    print(f"ratio (splitserve / transformers): {s['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
