"""`splitserve bench profile`: torch.profiler over one window of workload c on the real
engine and over one KV hand-off between two processes, summarised.

Engine (bench/profile_engine.py): nano-vllm's workload c (256 requests, prompts and
outputs U[100, 1024]; `--scale` shrinks it); on CUDA a known shape with dummy weights
(default llama3-8b), on the CPU a tiny random Llama and c at scale 0.125. Profiled: a
window of mixed steps (`--mixed-steps`) and `--decode-steps` decode steps once every
prefill is done. Per step (medians): wall, host and device µs, kernels, launch calls,
the device's idle gaps between kernels (sum, largest), host µs per engine phase.

Hand-off (bench/profile_handoff.py): `--handoff-tokens` scattered tokens in
`--handoff-chunks` writes, sender and receiver profiled; per hand-off: chunks, round
trips per chunk, notices, copy µs against the fixed rest.

A "kernel" on the CPU is a top-level aten op (one launch's worth of work) and device
time the time inside those ops. Every figure is taken under the profiler, which adds
its own cost to each op it records (host time most): `bench host` has the engine's
host time without it. Writes a Chrome trace per part under `--trace-dir`
(chrome://tracing, ui.perfetto.dev) and with `--json` the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from bench.report import machine
from bench.transfer_handoff import LAYOUTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    from engine.cli import add_kv_cache_dtype_argument, model_shape_arg

    p.add_argument("--parts", default="engine,handoff",
                   help="comma-separated: engine, handoff (default both)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--trace-dir", default="bench-results/profile",
                   help="one Chrome trace per profiled part")
    p.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("engine (workload c by default)")
    e.add_argument("--workload", choices=("a", "b", "c"), default="c",
                   help="bench engine's workload: a (one request), b (64), c (nano-vllm's "
                        "256)")
    e.add_argument("--model-shape", type=model_shape_arg, default=None,
                   help="known shape, dummy weights (default: llama3-8b on cuda; on cpu a "
                        "tiny random llama)")
    e.add_argument("--hidden-size", type=int, default=64, help="the cpu's tiny model")
    e.add_argument("--num-layers", type=int, default=2, help="the cpu's tiny model")
    e.add_argument("--scale", type=float, default=None,
                   help="workload c's request count and lengths x this (default 1 on "
                        "cuda, 0.125 on cpu)")
    e.add_argument("--decode-steps", type=int, default=None,
                   help="profiled decode steps (default 20 on cuda, 6 on cpu)")
    e.add_argument("--mixed-steps", type=int, default=4,
                   help="profiled steps while prefills run (0: none)")
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default 16384 on cuda, 512 on cpu (several mixed steps)")
    e.add_argument("--attention-backend", choices=["torch", "triton"], default=None)
    e.add_argument("--enforce-eager", action="store_true")
    e.add_argument("--max-graph-tokens", type=int, default=512)
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    add_kv_cache_dtype_argument(p)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    h = p.add_argument_group("KV hand-off")
    h.add_argument("--transports", default=None,
                   help="default: cuda_ipc,ucx on cuda; tcp,shm on cpu")
    h.add_argument("--layout", choices=sorted(LAYOUTS), default=None,
                   help="KV shape (default llama3-8b on cuda, small on cpu)")
    h.add_argument("--handoff-tokens", type=int, default=None,
                   help="prompt tokens per hand-off (default 8192 on cuda, 2048 on cpu)")
    h.add_argument("--handoff-chunks", type=int, default=4, help="writes per hand-off")
    h.add_argument("--handoffs", type=int, default=3, help="profiled hand-offs")


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fills the per-device defaults in `args`."""
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = args.device.startswith("cuda")
    if cuda and args.model_shape is None:
        args.model_shape = "llama3-8b"
    args.scale = args.scale if args.scale is not None else (1.0 if cuda else 0.125)
    if args.decode_steps is None:
        args.decode_steps = 20 if cuda else 6
    args.max_num_batched_tokens = args.max_num_batched_tokens or (None if cuda else 512)
    args.transports = args.transports or ("cuda_ipc,ucx" if cuda else "tcp,shm")
    args.layout = args.layout or ("llama3-8b" if cuda else "small")
    if args.handoff_tokens is None:
        args.handoff_tokens = 8192 if cuda else 2048
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if not parts or parts - {"engine", "handoff"}:
        raise SystemExit("--parts takes engine, handoff or engine,handoff")
    if args.decode_steps < 1 or args.mixed_steps < 0 or args.handoffs < 1 \
            or args.handoff_chunks < 1 or args.handoff_tokens < 1:
        raise SystemExit("--decode-steps, --handoffs, --handoff-chunks, --handoff-tokens "
                         ">= 1; --mixed-steps >= 0")
    args.parts = sorted(parts)


def run(args: argparse.Namespace) -> int:
    resolve_defaults(args)
    if not args.device.startswith("cuda"):
        import torch

        # one thread, as `bench host`: a shared machine's other work does not stall an
        # op's worker threads (the aten ops are then the same thread's, in order)
        torch.set_num_threads(1)
    os.makedirs(args.trace_dir, exist_ok=True)
    result: dict[str, Any] = {"config": {k: v for k, v in vars(args).items()
                                         if not k.startswith("_")}}
    if "engine" in args.parts:
        from bench.profile_engine import profile_engine

        result["engine"] = profile_engine(args, args.trace_dir)
        print_engine(result["engine"])
    if "handoff" in args.parts:
        from bench.profile_handoff import profile_handoffs
        from kvtransfer import KVLayout

        layout = KVLayout(**LAYOUTS[args.layout])
        result["handoff"] = profile_handoffs(
            [t.strip() for t in args.transports.split(",") if t.strip()], args.device,
            layout, args.handoff_tokens, args.handoff_chunks, args.handoffs, args.trace_dir)
        print_handoffs(result["handoff"], layout)
    result["summary"] = summary(result)
    result["created"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    result["machine"] = machine()
    if args.device.startswith("cuda"):
        import torch

        result["machine"]["gpu"] = result["device"] = torch.cuda.get_device_name(args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"traces in {os.path.abspath(args.trace_dir)}")
    return 0


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The headline figures, flat: `<window>_<figure>` and `<transport>_<figure>`."""
    out: dict[str, Any] = {}
    for name, w in result.get("engine", {}).get("windows", {}).items():
        for k in ("wall_us", "host_us", "device_us", "kernels", "launch_calls",
                  "gap_sum_us", "gap_max_us"):
            out[f"{name}_{k}"] = w["summary"][k]
    for t, h in result.get("handoff", {}).items():
        s = h["sender"]
        for k in ("wall_us", "copy_us", "fixed_us", "chunks", "round_trips_per_chunk",
                  "notices_per_chunk", "gbps"):
            out[f"{t}_{k}"] = s[k]
    return out


# The printed tables' columns: (header, key of a row's figures, format).
ENGINE_COLUMNS = (("steps", "steps", ""), ("wall us", "wall_us", ".0f"),
                  ("host us", "host_us", ".0f"), ("device us", "device_us", ".0f"),
                  ("kernels", "kernels", ".0f"), ("launches", "launch_calls", ".0f"),
                  ("gap sum us", "gap_sum_us", ".0f"), ("gap max us", "gap_max_us", ".0f"))
HANDOFF_COLUMNS = (("wall us", "wall_us", ".0f"), ("copy us", "copy_us", ".0f"),
                   ("fixed us", "fixed_us", ".0f"), ("GB/s", "gbps", ".2f"),
                   ("chunks", "chunks", ".0f"), ("rt/chunk", "round_trips_per_chunk", ".2f"),
                   ("notice/chunk", "notices_per_chunk", ".2f"),
                   ("finish us", "finish_wait_us", ".0f"))


def _print_table(first: str, columns: tuple[tuple[str, str, str], ...],
                 rows: dict[str, dict[str, Any]], width: int) -> None:
    """A header line (`first`, then the columns' headers), then a line per row: its
    name, then its figures; every cell right-aligned in `width` characters."""
    print("".join(f"{h:>{width}}" for h in (first, *(c[0] for c in columns))))
    for name, figures in rows.items():
        print(f"{name:>{width}}" + "".join(format(figures[key], f">{width}{fmt}")
                                          for _, key, fmt in columns))


def print_engine(r: dict[str, Any]) -> None:
    print(f"engine: workload {r.get('workload_name', 'c')}, {r['workload']} "
          f"(+{r['extra_output_tokens']} output tokens "
          f"each), {r['model']}, {r['dtype']} on {r['device']}; decode batch "
          f"{r['decode_batch']}")
    _print_table("window", ENGINE_COLUMNS, {n: w["summary"] for n, w in r["windows"].items()},
                 11)
    for name, w in r["windows"].items():
        phases = "  ".join(f"{p.removeprefix('engine.')} {v:.0f}"
                           for p, v in w["summary"]["phases_us"].items())
        print(f"  {name} phases (host us, median): {phases}; steps {w['kinds']}")
    kernel = next(iter(r["windows"].values()))["kernel"]
    print(f"  medians per step; a kernel is a {kernel}")
    for name, w in r["windows"].items():
        print(f"  {name}: kernels by device time (us per step, launches per step)")
        for k in w.get("top_kernels", []):
            print(f"    {k['us_per_step']:10.1f} {k['per_step']:6.1f}  {k['name'][:100]}")


def print_handoffs(rows: dict[str, Any], layout: Any) -> None:
    if not rows:
        return
    first = next(iter(rows.values()))
    print(f"hand-off: {first['tokens']} tokens ({first['blocks']} scattered blocks of "
          f"{layout.block_bytes / 2**10:.0f} KiB) in {first['chunks_asked']} writes; "
          f"means over {first['sender']['handoffs']} hand-offs")
    _print_table("transport", HANDOFF_COLUMNS, {t: h["sender"] for t, h in rows.items()}, 13)
    for t, h in rows.items():
        rx = ", ".join(f"{k} {v['calls']:.0f}x {v['us']:.0f} us"
                       for k, v in h["receiver"].items() if isinstance(v, dict) and v["calls"])
        print(f"  {t} receiver per hand-off: {rx or '-'}")


def markdown(result: dict[str, Any]) -> list[str]:
    """A run's figures as Markdown tables (docs/benchmarks.md): medians per step of each
    window, means per hand-off of each transport."""
    lines: list[str] = []
    if engine := result.get("engine"):
        lines += [f"Workload {engine.get('workload_name', 'c')}, {engine['workload']} "
                  f"(+{engine['extra_output_tokens']} output "
                  f"tokens each), {engine['model']}, {engine['dtype']}; decode batch "
                  f"{engine['decode_batch']}. Medians per step, µs:", "",
                  "| window | steps | wall | host | device | kernels | launch calls | "
                  "gap sum | gap max | schedule | inputs | forward | sample | update | "
                  "outputs |", "|---|" + "---|" * 14]
        for name, w in engine["windows"].items():
            s = w["summary"]
            cells = [s[k] for k in ("wall_us", "host_us", "device_us", "kernels",
                                    "launch_calls", "gap_sum_us", "gap_max_us")]
            cells += list(s["phases_us"].values())
            lines.append(f"| {name} | {s['steps']} | " + " | ".join(f"{v:,.0f}" for v in cells)
                         + " |")
        lines.append("")
        for name, w in engine["windows"].items():
            if w.get("top_kernels"):
                lines += [f"The {name} window's kernels by device time:", "",
                          "| kernel | µs per step | launches per step |", "|---|---|---|"]
                lines += [f"| `{k['name'][:100]}` | {k['us_per_step']:,.1f} | "
                          f"{k['per_step']:.1f} |" for k in w["top_kernels"]]
                lines.append("")
    if handoff := result.get("handoff"):
        first = next(iter(handoff.values()))
        lines += [f"Hand-off of {first['tokens']} tokens ({first['blocks']} scattered blocks) "
                  f"in {first['chunks_asked']} writes; means over "
                  f"{first['sender']['handoffs']} hand-offs:", "",
                  "| transport | wall µs | copy µs | fixed µs | GB/s | chunks | round trips "
                  "per chunk | notices per chunk | finish wait µs |", "|---|" + "---|" * 8]
        for t, h in handoff.items():
            s = h["sender"]
            lines.append(f"| {t} | {s['wall_us']:,.0f} | {s['copy_us']:,.0f} | "
                         f"{s['fixed_us']:,.0f} | {s['gbps']:.2f} | {s['chunks']:.0f} | "
                         f"{s['round_trips_per_chunk']:.2f} | {s['notices_per_chunk']:.2f} | "
                         f"{s['finish_wait_us']:,.0f} |")
        lines.append("")
    return lines
