"""`splitserve bench layout`: which KV block interior serves a tensor-parallel rank's
head slice best, measured on this machine's device.

A block's interior is [layers, K/V, token, head, dim] today (token-major: the cache
`engine.kv_sizing.kv_cache_shape` allocates). One rank's KV heads of a block are
then one strided run per (layer, K/V, token) of heads/TP x dim elements. A head-major
interior [layers, K/V, head, token, dim] makes them one run per (layer, K/V).

For a real shape (default llama3-8b: 32 layers, 8 KV heads of 128, 16-token blocks,
bfloat16) over a pool of scattered blocks, each repetition times, in turn: the
full-block gather (the reference: what a TP 1 hand-off moves), and for each TP size
rank 0's head slice gathered from each layout into one contiguous buffer. On CUDA a
gather is one `index_select` kernel; on CPU one `copy_` per block (torch's CPU
`index_select` of multi-dimensional rows runs element by element, which would time
that kernel, not the layout). The gathered values are checked equal across layouts
before timing. On CPU the gathers run on one thread and are timed in that thread's
CPU time (on a shared machine, wall time would count other jobs' turns on the cores);
on CUDA in wall time to a synchronize. Figures are medians (and bests) over the
repetitions; `slice_vs_full`
is a slice gather's time over the full-block gather's (1/TP would be pure bandwidth),
`token_vs_head` token-major's time over head-major's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from typing import Any

import torch

MIB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-shape", default="llama3-8b",
                   help="a shape from engine/model_shapes, or a config.json path")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tp", default="2,4", help="comma-separated TP sizes to slice for")
    p.add_argument("--blocks", type=int, default=32, help="blocks gathered per call")
    p.add_argument("--pool-mib", type=int, default=512,
                   help="the pool the blocks are scattered over (out of cache)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here")


def shape_of(name: str) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a model shape."""
    from engine.config import ModelConfig
    from engine.model_shapes import load_shape

    cfg = ModelConfig.from_dict(load_shape(name))
    parts, heads, head_dim = cfg.kv_cache_dims
    if parts != 2:
        raise SystemExit(f"{name}: a latent (MLA) cache has no KV heads to slice")
    return cfg.num_layers, heads, head_dim


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Probe:
    """The two pools (the same blocks in each layout) and the gathers timed."""

    def __init__(self, layers: int, heads: int, head_dim: int, block_size: int,
                 pool_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
        self.heads = heads
        self.device = device
        # token-major [P, L, 2, T, H, D] and the same values head-major [P, L, 2, H, T, D]
        self.token_major = torch.randn(pool_blocks, layers, 2, block_size, heads, head_dim,
                                       dtype=dtype, device=device)
        self.head_major = self.token_major.transpose(3, 4).contiguous()
        self.block_bytes = self.token_major[0].numel() * self.token_major.element_size()

    def gathers(self, tp: int, n: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """name -> (source view, output buffer) of each gather, rank 0's heads for `tp`."""
        h = max(1, self.heads // tp)
        tok = self.token_major[:, :, :, :, :h]
        head = self.head_major[:, :, :, :h]
        return {
            "full": (self.token_major, torch.empty_like(self.token_major[:n])),
            f"tp{tp}_token_major": (tok, torch.empty((n, *tok.shape[1:]), dtype=tok.dtype,
                                                     device=self.device)),
            f"tp{tp}_head_major": (head, torch.empty((n, *head.shape[1:]), dtype=head.dtype,
                                                     device=self.device)),
        }

    def gather(self, src: torch.Tensor, out: torch.Tensor, ids: torch.Tensor) -> None:
        """out[i] = src[ids[i]]: blocks `ids` of `src` (a view) into contiguous `out`."""
        if self.device.type == "cuda":
            torch.index_select(src, 0, ids, out=out)
            return
        for i, b in enumerate(ids.tolist()):
            out[i].copy_(src[b])

    def check(self, tp: int, ids: torch.Tensor) -> None:
        """Both layouts' slices hold the same values (the measurement gathers real data)."""
        g = self.gathers(tp, len(ids))
        (tok, a), (head, b) = g[f"tp{tp}_token_major"], g[f"tp{tp}_head_major"]
        self.gather(tok, a, ids)
        self.gather(head, b, ids)
        if not torch.equal(a.transpose(3, 4), b):
            raise RuntimeError(f"TP {tp}: the two layouts' head slices differ")
        full = g["full"][1]
        self.gather(self.token_major, full, ids)
        if not torch.equal(full[:, :, :, :, :a.shape[4]], a):
            raise RuntimeError(f"TP {tp}: the head slice is not the blocks' first heads")

    def time(self, src: torch.Tensor, out: torch.Tensor, ids: torch.Tensor) -> float:
        clock = time.perf_counter if self.device.type == "cuda" else time.thread_time
        _sync(self.device)
        t0 = clock()
        self.gather(src, out, ids)
        _sync(self.device)
        return clock() - t0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    layers, heads, head_dim = shape_of(args.model_shape)
    tps = [int(t) for t in args.tp.split(",")]
    if min(tps) < 1 or args.blocks < 1 or args.repeats < 1:
        raise SystemExit("--tp, --blocks and --repeats must be positive")
    dtype = getattr(torch, args.dtype)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # the thread's CPU time is then the whole gather's
    try:
        return _measure(args, device, layers, heads, head_dim, tps, dtype)
    finally:
        torch.set_num_threads(threads)


def _measure(args: argparse.Namespace, device: torch.device, layers: int, heads: int,
             head_dim: int, tps: list[int], dtype: torch.dtype) -> dict[str, Any]:
    per_block = layers * 2 * args.block_size * heads * head_dim * dtype.itemsize
    pool = max(args.blocks, args.pool_mib * MIB // per_block)
    probe = Probe(layers, heads, head_dim, args.block_size, pool, dtype, device)
    gen = torch.Generator().manual_seed(args.seed)
    gathers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for tp in tps:
        probe.check(tp, torch.randperm(pool, generator=gen)[:args.blocks].to(device))
        gathers.update(probe.gathers(tp, args.blocks))
    times: dict[str, list[float]] = {name: [] for name in gathers}
    for _ in range(args.repeats + 1):  # the first round warms up, untimed
        ids = torch.randperm(pool, generator=gen)[:args.blocks].to(device)
        for name, (src, out) in gathers.items():  # interleaved: noise hits all alike
            times[name].append(probe.time(src, out, ids))
    rows = []
    full = statistics.median(times["full"][1:])
    for name, (_, out) in gathers.items():
        t = statistics.median(times[name][1:])
        nbytes = out.numel() * out.element_size()
        rows.append({"gather": name, "bytes": nbytes, "median_ms": t * 1e3,
                     "best_ms": min(times[name][1:]) * 1e3, "gbps": nbytes / t / 1e9,
                     "vs_full": t / full})
    summary: dict[str, Any] = {}
    for tp in tps:
        h = max(1, heads // tp)
        tok = statistics.median(times[f"tp{tp}_token_major"][1:])
        head = statistics.median(times[f"tp{tp}_head_major"][1:])
        summary[f"tp{tp}_token_major_slice_vs_full"] = round(tok / full, 3)
        summary[f"tp{tp}_head_major_slice_vs_full"] = round(head / full, 3)
        summary[f"tp{tp}_token_vs_head"] = round(tok / head, 3)
        summary[f"tp{tp}_run_bytes_token_major"] = h * head_dim * dtype.itemsize
        summary[f"tp{tp}_run_bytes_head_major"] = h * args.block_size * head_dim * dtype.itemsize
    return {"device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
            "shape": {"model_shape": args.model_shape, "layers": layers, "kv_heads": heads,
                      "head_dim": head_dim, "block_size": args.block_size,
                      "dtype": args.dtype, "block_bytes": per_block},
            "blocks": args.blocks, "pool_blocks": pool, "repeats": args.repeats,
            "threads": torch.get_num_threads(), "summary": summary, "rows": rows}


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| gather | MiB | median ms | best ms | GB/s (median) | time vs full blocks |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['gather']} | {r['bytes'] / MIB:.0f} | {r['median_ms']:.2f} | "
                     f"{r['best_ms']:.2f} | {r['gbps']:.2f} | {r['vs_full']:.3f} |")
    return lines


def run(args: argparse.Namespace) -> int:
    result = measure(args)
    s = result["shape"]
    print(f"{s['model_shape']}: {s['layers']} layers x {s['kv_heads']} KV heads x "
          f"{s['head_dim']}, {s['block_size']}-token blocks ({s['block_bytes'] / MIB:.2f} MiB), "
          f"{result['blocks']} of {result['pool_blocks']} blocks per gather on "
          f"{result['device']}")
    print("\n".join(table(result["rows"])))
    for k, v in result["summary"].items():
        print(f"{k}: {v}")
    if args.json:
        from bench.report import machine

        cmd = ["splitserve bench layout", f"--model-shape {args.model_shape}",
               f"--tp {args.tp}", f"--blocks {args.blocks}", f"--pool-mib {args.pool_mib}",
               f"--repeats {args.repeats}", f"--json {args.json}"]
        report = {
            "name": "layout",
            "title": "KV block interior: one TP rank's head slice, token-major vs head-major",
            "created": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "machine": machine(), "command": " ".join(cmd), "config": result["shape"],
            "summary": result["summary"], "tables": [table(result["rows"])],
            "notes": [f"{result['blocks']} blocks scattered over a {result['pool_blocks']}"
                      f"-block pool per gather, {result['repeats']} interleaved repetitions "
                      f"(medians), device {result['device']}, {result['threads']} thread(s); "
                      "on CPU, times are the gathering thread's CPU time"],
            "plots": [], "result": result}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="splitserve bench layout", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))
