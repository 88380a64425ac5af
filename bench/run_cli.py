"""`splitserve bench run --url URL`: measure a running server (splitserve's gateway,
vLLM, any OpenAI-compatible server, or splitserve gRPC) with one workload under one load
shape or a sweep of rates; writes JSON, Markdown and PNG plots.

    splitserve bench run --url http://127.0.0.1:8000 --dataset synthetic \\
        --input-len 256 --output-len 64 --load poisson --rates 1,2,4 \\
        --slo ttft=0.5,tpot=0.05 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from bench.base import BenchError, BenchRequest
from bench.load import KINDS, LoadSpec

DATASETS = ("synthetic", "shared-prefix", "multi-turn", "sharegpt", "mooncake")


def add_dataset_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="synthetic")
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON / Mooncake JSONL")
    g.add_argument("--tokenizer", default=None,
                   help="model directory whose tokenizer.json builds prompts "
                        "(default: the embedded model's)")
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--input-dist", choices=["constant", "normal", "uniform"],
                   default="constant")
    g.add_argument("--input-spread", type=float, default=0.0,
                   help="normal: std dev; uniform: half width")
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--output-dist", choices=["constant", "normal", "uniform"],
                   default="constant")
    g.add_argument("--output-spread", type=float, default=0.0)
    g.add_argument("--num-groups", type=int, default=4, help="shared-prefix groups")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix length")
    g.add_argument("--turns", type=int, default=3, help="multi-turn: turns per session")
    g.add_argument("--multi-turn", action="store_true", help="ShareGPT: all turns")
    g.add_argument("--block-tokens", type=int, default=512,
                   help="Mooncake: tokens per hash id (512 = the trace's own)")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="Mooncake: multiply trace times (0.5 = twice as fast)")
    g.add_argument("--output-scale", type=float, default=1.0, help="Mooncake output lengths x")
    g.add_argument("--max-input-len", type=int, default=None)
    g.add_argument("--max-output-len", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True,
                   help="http://host:port (OpenAI backends) or host:port (grpc)")
    p.add_argument("--backend", choices=["openai", "openai-chat", "grpc"], default="openai")
    p.add_argument("--model", default="", help="model name to send (default: the served one)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""))
    p.add_argument("--token-chunks", action="store_true",
                   help="openai backends: ask for each token's logprob so every token makes "
                        "a chunk (time tokens, not text: a model shape's dummy weights mostly "
                        "sample ids without text)")
    add_dataset_arguments(p)
    g = p.add_argument_group("load")
    g.add_argument("--load", choices=KINDS, default=None,
                   help="default: trace for mooncake, else concurrency")
    g.add_argument("--rate", type=float, default=None, help="req/s (constant, poisson)")
    g.add_argument("--rates", default=None, help="sweep: comma-separated req/s")
    g.add_argument("--concurrency", type=int, default=4)
    g.add_argument("--max-concurrency", type=int, default=0)
    p.add_argument("--slo", default="", help="e.g. ttft=0.5,tpot=0.05 (seconds)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--timeout", type=float, default=1800.0, help="per phase, seconds")
    p.add_argument("--name", default="run", help="report file stem")
    p.add_argument("--out-dir", default="bench-results")
    p.add_argument("--json", default=None, help="also write the JSON report here")
    p.add_argument("--no-progress", action="store_true")


def build_dataset(args: argparse.Namespace) -> list[BenchRequest]:
    from bench import datasets as ds

    tok_dir = args.tokenizer or _default_tokenizer_dir()
    if args.dataset in ("sharegpt", "mooncake") and not args.dataset_path:
        raise BenchError(f"--dataset {args.dataset} needs --dataset-path")
    if args.dataset == "sharegpt":
        return ds.sharegpt(args.dataset_path, ds.TokenCounter(tok_dir), args.num_prompts,
                           args.multi_turn, args.max_input_len, args.max_output_len)
    pool = ds.TokenPool.from_tokenizer_dir(tok_dir, args.seed)
    if args.dataset == "mooncake":
        return ds.mooncake(args.dataset_path, pool, args.num_prompts, args.block_tokens,
                           args.time_scale, args.output_scale, args.max_output_len,
                           args.max_input_len)
    if args.dataset == "shared-prefix":
        per_group = max(1, args.num_prompts // args.num_groups)
        return ds.shared_prefix(pool, args.num_groups, per_group, args.prefix_len,
                                args.input_len, args.output_len, args.seed)
    if args.dataset == "multi-turn":
        sessions = max(1, args.num_prompts // args.turns)
        return ds.multi_turn(pool, sessions, args.turns, args.input_len, args.output_len,
                             args.seed)
    hi = args.max_input_len or 1 << 20
    return ds.synthetic(
        pool, args.num_prompts,
        ds.LengthDist(args.input_dist, args.input_len, args.input_spread, hi=hi),
        ds.LengthDist(args.output_dist, args.output_len, args.output_spread,
                      hi=args.max_output_len or 1 << 20), args.seed)


def _default_tokenizer_dir() -> str:
    from engine.default_model import default_model_dir

    d = default_model_dir()
    if not os.path.isfile(os.path.join(d, "tokenizer.json")):
        raise BenchError("no --tokenizer given and the embedded model is not built yet "
                         "(run `splitserve up` once, or pass --tokenizer MODEL_DIR)")
    return d


def load_specs(args: argparse.Namespace) -> list[LoadSpec]:
    kind = args.load or ("trace" if args.dataset == "mooncake" else "concurrency")
    if args.rates:
        try:
            rates = [float(r) for r in args.rates.split(",") if r.strip()]
        except ValueError as e:
            raise BenchError(f"--rates must be comma-separated numbers: {args.rates!r}") from e
        kind = kind if kind in ("constant", "poisson") else "poisson"
        return [LoadSpec(kind, rate=r, max_concurrency=args.max_concurrency, seed=args.seed)
                for r in rates]
    return [LoadSpec(kind, rate=args.rate or 0.0, concurrency=args.concurrency,
                     max_concurrency=args.max_concurrency, seed=args.seed)]


async def measure(args: argparse.Namespace, requests: list[BenchRequest],
                  specs: list[LoadSpec], slo: dict[str, float]) -> list[Any]:
    from bench.clients import make_client
    from bench.runner import run_phase

    client = make_client(args.backend, args.url, model=args.model,
                         timeout_s=args.request_timeout,
                         **({"api_key": args.api_key, "token_chunks": args.token_chunks}
                            if args.backend != "grpc" else {}))
    try:
        phases = []
        for spec in specs:
            params = {"rate": spec.rate} if spec.kind in ("constant", "poisson") else {}
            phases.append(await run_phase(client, requests, spec, name=spec.label, slo=slo,
                                          progress=not args.no_progress,
                                          timeout_s=args.timeout, params=params))
        return phases
    finally:
        await client.close()


def run(args: argparse.Namespace) -> int:
    from bench.metrics import parse_slo
    from bench.report import Report, write_report

    try:
        slo = parse_slo(args.slo)
        requests = build_dataset(args)
        specs = load_specs(args)
    except (BenchError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        phases = asyncio.run(measure(args, requests, specs, slo))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "api_key"}
    report = Report(args.name, f"splitserve bench run: {args.url} ({args.dataset})", phases,
                    config=config)
    paths = write_report(report, args.out_dir, args.json)
    from bench.report import phase_table

    print("\n".join(phase_table(phases)))
    print(f"wrote {paths['markdown']}, {', '.join(paths['json'])}, {len(paths['plots'])} plots")
    return 0 if all(p.summary["completed"] for p in phases) else 1
