"""`splitserve sim links`: measures the links a hardware profile times KV movement with
(sim/profile.py: `seconds = latency_s + bytes / bandwidth_bytes_s`), through the
production code, on this machine's device:

- **host**, **disk**: kvtransfer's `TieredCache` with one tier (the host DRAM tier, pinned
  where CUDA is; the disk tier, O_DIRECT where the filesystem takes it) restores the
  first n of its blocks into an engine-shaped KV cache on `--device`, as the engine does
  on a prefix hit (`lookup` + `load`, checked bit-exact), for each n in `--blocks`; a
  size's figure is its best of `--repeats` interleaved restores (the box is shared).
  The blocks have the KV layout of `--model-shape` (llama3-8b: 32 layers x 8 KV heads x
  head dim 128 x 16 tokens, bf16 = 2 MiB per block).
- **kv**: the rows of a `splitserve bench transfer --json` run (prompt hand-offs between
  two processes over the production transport, blocks scattered in the pool as the
  engine holds them) for `--transport`.

Each link is the least-squares line through its (bytes, seconds) points, weighted by
1/seconds (relative error; a small transfer counts as much as a big one), with the
fixed cost clamped at >= 0. `splitserve sim calibrate --links-json FILE` puts the links in
a profile, each with its source and fit error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sim.profile import LinkSpec

if TYPE_CHECKING:
    from kvtransfer.layout import KVLayout

LINKS = ("kv", "host", "disk")
DEFAULT_BLOCKS = "1,4,16,64,256"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="write the links and their points here")
    p.add_argument("--device", default="cpu", help="where the KV cache lives (cpu, cuda)")
    p.add_argument("--model-shape", default="llama3-8b",
                   help="the KV layout's model (engine/model_shapes name or config.json)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--blocks", default=DEFAULT_BLOCKS,
                   help="restore sizes in blocks, comma-separated (the largest is stored)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--disk-dir", default=None, help="the disk tier's directory (default: "
                   "a temporary one under the working directory, not /tmp's tmpfs)")
    p.add_argument("--transfer-json", default=None, metavar="PATH",
                   help="a `bench transfer --json` file: the kv link from its rows")
    p.add_argument("--transport", default="ucx", help="which of its transports is kv")
    p.add_argument("--mode", default="scattered", choices=["scattered", "contiguous"],
                   help="which of its block placements (the engine's pool scatters)")


def fit_link(points: list[tuple[int, float]]) -> tuple[LinkSpec, float]:
    """The line `latency + bytes / bandwidth` through (bytes, seconds) points, least
    squares on relative error, latency >= 0; and its relative RMS error."""
    if len(points) < 2 or len({b for b, _ in points}) < 2:
        raise ValueError("a link needs points at two sizes at least")
    x = np.array([float(b) for b, _ in points])
    t = np.array([s for _, s in points])
    if not (t > 0).all() or not (x > 0).all():
        raise ValueError("link points need bytes > 0 and seconds > 0")
    w = 1.0 / t
    a = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (lat, per_byte), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    if lat < 0:  # through the origin
        lat, per_byte = 0.0, float(np.sum(w * w * x * t) / np.sum(w * w * x * x))
    if per_byte <= 0:
        raise ValueError(f"link points do not grow with size: {points}")
    err = float(np.sqrt(np.mean(((lat + per_byte * x) / t - 1.0) ** 2)))
    return LinkSpec(1.0 / float(per_byte), float(lat)), err


def transfer_points(path: str, transport: str, mode: str) -> tuple[list[tuple[int, float]],
                                                                      dict[str, Any]]:
    """(bytes, p50 seconds) per hand-off size of `transport` in a `bench transfer --json`
    file, and what the run was."""
    with open(path) as f:
        d = json.load(f)
    rows = [r for r in d.get("rows", []) if r.get("transport") == transport
            and r.get("mode", "contiguous") == mode]
    if not rows:
        have = sorted({(r.get("transport"), r.get("mode")) for r in d.get("rows", [])})
        raise SystemExit(f"{path}: no {transport} rows in mode {mode} (it has {have})")
    return ([(int(r["bytes"]), float(r["p50_ms"]) / 1e3) for r in rows],
            {"device": d.get("device"), "layout": d.get("layout"), "file": os.path.basename(path)})


def shape_layout(shape: str, block_size: int, dtype: str) -> KVLayout:
    from engine.config import ModelConfig
    from engine.model_shapes import load_shape
    from kvtransfer.layout import KVLayout

    m = ModelConfig.from_dict(load_shape(shape))
    return KVLayout(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                    block_size=block_size, dtype=dtype)


def measure_tiers(layout: KVLayout, device: str, sizes: list[int], repeats: int,
                  disk_dir: str) -> dict[str, dict[str, Any]]:
    """Per tier: its kind ("pinned", "O_DIRECT", ...) and (bytes, best seconds) per
    restore size, restores interleaved across tiers and sizes."""
    import torch

    from bench.tiers_bench import make_blocks, restore, tier_kind
    from kvtransfer.tiers import TierConfig
    from kvtransfer.tiers.manager import TieredCache

    n = max(sizes)
    hashes, data = make_blocks(layout, n)
    data = data.to(device)
    kv = torch.zeros_like(data)
    configs = {"host": TierConfig(host_blocks=n, pin_memory=None),
               "disk": TierConfig(disk_dir=disk_dir, disk_blocks=n)}
    opened: dict[str, TieredCache] = {}
    try:
        for name, config in configs.items():
            opened[name] = tiers = TieredCache(config, layout)
            tiers.put(hashes, list(data))
            if tiers.lookup(hashes) != n:
                raise SystemExit(f"tier {name}: stored {tiers.lookup(hashes)} of {n} blocks")
        best: dict[str, dict[int, float]] = {name: {} for name in opened}
        for _ in range(repeats):
            for name, tiers in opened.items():
                for k in sizes:
                    # into the cache's first k blocks (views), checked bit-exact
                    s = restore(name, tiers, hashes[:k], kv[:k], data[:k])
                    best[name][k] = min(best[name].get(k, s), s)
        return {name: {"kind": tier_kind(tiers),
                       "points": [(k * layout.block_bytes, best[name][k]) for k in sizes]}
                for name, tiers in opened.items()}
    finally:
        for tiers in opened.values():
            tiers.close()


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


def run(args: argparse.Namespace) -> int:
    sizes = sorted({int(s) for s in args.blocks.split(",") if s.strip()})
    if len(sizes) < 2 or sizes[0] <= 0:
        raise SystemExit("--blocks needs two positive sizes at least")
    if args.repeats <= 0:
        raise SystemExit("--repeats must be positive")
    layout = shape_layout(args.model_shape, args.block_size, args.dtype)
    print(f"measuring host and disk restores of {sizes} blocks of "
          f"{layout.block_bytes / (1 << 20):.3g} MiB into {args.device}...", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=args.disk_dir or os.getcwd(),
                                     prefix=".sim-links-") as disk:
        measured = measure_tiers(layout, args.device, sizes, args.repeats, disk)
    out: dict[str, Any] = {
        "device": device_name(args.device),
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "layout": {"model_shape": args.model_shape, "block_bytes": layout.block_bytes,
                   "block_size": layout.block_size, "dtype": layout.dtype},
        "links": {}, "fits": {}}
    for name, m in measured.items():
        try:
            link, err = fit_link(m["points"])
        except ValueError as e:
            raise SystemExit(f"{name}: {e} (a stalled restore: more --repeats?)") from e
        out["links"][name] = {"bandwidth_bytes_s": link.bandwidth_bytes_s,
                              "latency_s": link.latency_s}
        out["fits"][name] = {
            "source": f"TieredCache {name} tier ({m['kind']}) restores into a KV cache on "
                      f"{out['device']}, best of {args.repeats}",
            "points": m["points"], "relative_rms_error": round(err, 4)}
    if args.transfer_json:
        points, run_info = transfer_points(args.transfer_json, args.transport, args.mode)
        link, err = fit_link(points)
        out["links"]["kv"] = {"bandwidth_bytes_s": link.bandwidth_bytes_s,
                              "latency_s": link.latency_s}
        out["fits"]["kv"] = {
            "source": f"bench transfer: {args.transport} hand-offs ({args.mode} blocks) "
                      f"between two processes on {run_info['device']} "
                      f"({run_info['file']}), p50 per size",
            "points": points, "relative_rms_error": round(err, 4)}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for name, link_d in out["links"].items():
        print(f"{name}: {link_d['bandwidth_bytes_s'] / 1e9:.3g} GB/s + "
              f"{link_d['latency_s'] * 1e6:.0f} us per transfer (fit error "
              f"{out['fits'][name]['relative_rms_error']:.1%})")
    print(f"wrote {args.out}")
    return 0


def load_links(path: str, names: Sequence[str] = LINKS
               ) -> tuple[dict[str, LinkSpec], list[str], dict[str, Any]]:
    """The links `names` of a `sim links` file, a note per link for the profile, and
    their fits."""
    with open(path) as f:
        d = json.load(f)
    names = [n.strip() for n in names if n.strip()]
    if unknown := sorted(set(names) - set(LINKS)):
        raise SystemExit(f"unknown links {unknown} (known: {', '.join(LINKS)})")
    if missing := sorted(set(names) - set(d["links"])):
        raise SystemExit(f"{path} has no {', '.join(missing)} link (it has "
                         f"{', '.join(d['links'])})")
    links = {k: LinkSpec(**d["links"][k]) for k in names}
    notes = [f"Link {k}: {links[k].bandwidth_bytes_s / 1e9:.3g} GB/s + "
             f"{links[k].latency_s * 1e6:.0f} us, measured by `splitserve sim links` "
             f"({d['fits'][k]['source']}; fit error {d['fits'][k]['relative_rms_error']:.1%})."
             for k in links]
    return links, notes, {k: {**d["fits"][k], "device": d["device"], "created": d["created"]}
                          for k in links}
