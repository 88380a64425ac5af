"""`splitserve bench experiment NAME`: start the configurations an experiment compares
(bench/experiments/), measure them in one run, write one report (JSON, Markdown, PNG);
`--publish` also copies it under docs/results/ and regenerates docs/benchmarks.md."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from bench.experiments import EXPERIMENTS
from engine.cli import model_shape_arg


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(EXPERIMENTS),
                   help="; ".join(f"{k}: {v[1]}" for k, v in EXPERIMENTS.items()))
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", default=None,
                       help="model directory (default: embedded model; with --device cuda "
                            "the llama3-8b shape)")
    which.add_argument("--model-shape", default=None, type=model_shape_arg,
                       help="a known model shape with random weights (load format dummy)")
    p.add_argument("--device", default="cpu",
                   help="transports experiment: cuda runs 1P1D and colocated on one GPU")
    p.add_argument("--quick", action="store_true", help="a few-second version")
    p.add_argument("--out-dir", default="bench-results")
    p.add_argument("--json", default=None, help="also write the JSON report here")
    p.add_argument("--publish", action="store_true",
                   help="copy the report into docs/results/ and regenerate docs/benchmarks.md")
    p.add_argument("--transports", default=None,
                   help="transports experiment (default: ucx,tcp,shm; cuda_ipc,ucx on cuda)")
    p.add_argument("--profiles", default="", help="routing experiment: extra profile YAMLs")
    p.add_argument("--trace", default="", help="routing experiment: Mooncake JSONL")
    p.add_argument("--slo", default="", help="goodput SLOs, e.g. ttft=0.5,tpot=0.05")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--phase-timeout", type=float, default=600.0)
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from bench.base import BenchError
    from bench.experiments.common import ExperimentConfig
    from bench.metrics import parse_slo
    from bench.report import write_report
    from cluster.launcher import ClusterError
    from engine.cli import resolve_model_and_format

    gpu = args.device.startswith("cuda")
    if gpu and args.name != "transports":
        print(f"error: --device {args.device}: only the transports experiment runs on a GPU",
              file=sys.stderr)
        return 2
    if gpu and args.model is None and args.model_shape is None:
        args.model_shape = "llama3-8b"  # the shape the hand-off figures use
    transports = args.transports or ("cuda_ipc,ucx" if gpu else "ucx,tcp,shm")
    try:
        model_dir, load_format = resolve_model_and_format(args)
        cfg = ExperimentConfig(
            model_dir=model_dir, out_dir=args.out_dir, quick=args.quick,
            seed=args.seed, progress=not args.no_progress, phase_timeout_s=args.phase_timeout,
            device=args.device, load_format=load_format,
            transports=tuple(t for t in transports.split(",") if t),
            slo=tuple(parse_slo(args.slo).items()),
            profiles=tuple(p for p in args.profiles.split(",") if p), trace_path=args.trace)
        module = importlib.import_module(EXPERIMENTS[args.name][0])
        report = module.run(cfg)
    except (BenchError, ClusterError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    paths = write_report(report, args.out_dir, args.json)
    if args.publish:
        from bench.results_page import publish

        print(f"results page: {publish(report, paths)}")
    with open(paths["markdown"]) as f:
        print(f.read())
    print(f"wrote {paths['markdown']}, {', '.join(paths['json'])}, {len(paths['plots'])} plots"
          f" (in {os.path.abspath(args.out_dir)})")
    return 0 if not report.summary.get("failed_requests") else 1
