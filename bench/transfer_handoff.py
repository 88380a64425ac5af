"""`splitserve bench transfer --device cuda` (or `--device cpu --handoffs`): whole
prompt hand-offs between two processes, against the same gather-scatter done by one
process inside its own memory.

A Llama-3-8B-shaped cache (32 layers, 8 KV heads, head dim 128, 16-token blocks,
bfloat16: 2 MiB a block; `--layout small` for host runs on small machines). A hand-off
of T tokens moves T/16 blocks from a run of the prefill's blocks into the decode's,
either one contiguous run (`contiguous`) or blocks scattered over the decode's pool
(`scattered`, as a decode's allocations usually are: one region per block). One
`write()` per hand-off (a whole prompt's chunk) then `finish()`, timed at the sender,
one hand-off at a time. The reference is `scatter_copy` (one Triton launch; on the CPU
one torch copy per region) from one part of a cache into another in one process.

Summary (`--json`): `copy_gbps`, `<transport>_gbps` (bandwidth of the largest
scattered hand-off), `<transport>_fixed_us` (latency of the smallest hand-off beyond
its bytes at that bandwidth), `<transport>_region_us` (what one more region costs: the
largest hand-off scattered, one region per block, against the same bytes contiguous, one
region, per extra region; null, "n/s" on the page, when that excess is within the noise of
the two medians), per transport `<transport>_vs_copy`. `copy_gbps` is the median of
the in-process copy measured before, between and after the transports' runs. The JSON also carries
the machine, the date and the tables `docs/benchmarks.md` shows (copied to
`docs/results/transfer-handoff.json`, it is that page's host section). Targets on an H100 /
H200: cuda_ipc >= 0.6x the copy and <= 150 µs fixed (issue 55), ucx >= 0.3x the copy. On CUDA
`copy.block_copy_gbps` is cuda_ipc's own kernel (every layer of the scattered blocks in
one launch) in one process: the ceiling of a cuda_ipc hand-off.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import statistics
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

LAYOUTS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                      dtype="bfloat16"),  # 2 MiB blocks
    "small": dict(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16,
                  dtype="bfloat16"),  # 32 KiB blocks
    # DeepSeek-V2-Lite's MLA cache: 512 latent + 64 rope values per token per layer
    "deepseek-v2-lite": dict(num_layers=27, num_kv_heads=1, head_dim=576, block_size=16,
                             dtype="bfloat16", name="mla_latent_v1"),  # 486 KiB blocks
}
TARGETS = {"cuda_ipc": 0.6, "ucx": 0.3}  # x the in-process copy (issues 13, 55)
FIXED_TARGETS_US = {"cuda_ipc": 150.0}
MODES = ("contiguous", "scattered")


@dataclass(frozen=True, slots=True)
class Row:
    transport: str
    mode: str
    tokens: int
    bytes: int
    handoffs: int
    p50_ms: float
    gbps: float
    iqr_ms: float = 0.0  # interquartile range of the hand-offs' times: their noise


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--handoff-tokens", default="128,512,2048,8192",
                   help="prompt lengths handed off (16 MiB .. 1 GiB with llama3-8b)")
    p.add_argument("--handoff-transports", default=None,
                   help="default: cuda_ipc,ucx on cuda; ucx,cuda_ipc,shm,tcp on cpu")
    p.add_argument("--handoffs", action="store_true",
                   help="with --device cpu: run this hand-off benchmark on host caches")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default=None,
                   help="KV shape (default llama3-8b on cuda, small on cpu)")
    p.add_argument("--repeats", type=int, default=8, help="hand-offs per size and mode")


def run(args: argparse.Namespace) -> int:
    from kvtransfer import KVLayout

    cuda = args.device.startswith("cuda")
    layout = KVLayout(**LAYOUTS[args.layout or ("llama3-8b" if cuda else "small")])
    tokens = [int(t) for t in args.handoff_tokens.split(",")]
    blocks = [-(-t // layout.block_size) for t in tokens]
    pool = 2 * max(blocks) + 8
    transports = (args.handoff_transports or ("cuda_ipc,ucx" if cuda
                                               else "ucx,cuda_ipc,shm,tcp")).split(",")
    # the copy baseline before, between and after the transports' runs: its median
    # holds up against the host's load changing over the run
    copies = [measure_copy(args.device, layout, pool, blocks, args.repeats)]
    rows: list[Row] = []
    for t in transports:
        rows += asyncio.run(bench(t.strip(), args.device, layout, pool, tokens, args.repeats))
        copies.append(measure_copy(args.device, layout, pool, blocks, args.repeats))
    copy = {k: statistics.median(c[k] for c in copies) for k in copies[0]}
    summary = summarize(rows, copy, tokens, layout.block_size)
    report(rows, copy, summary, layout)
    if args.json:
        from bench.report import machine

        with open(args.json, "w") as f:
            json.dump({"summary": summary, "copy": copy,
                       "rows": [asdict(r) for r in rows], "layout": asdict(layout),
                       "device": describe(args.device), "targets": TARGETS,
                       "fixed_targets_us": FIXED_TARGETS_US, "machine": machine(),
                       "created": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                       **page_fields(args, rows, layout)}, f, indent=2)
    return 0


def page_fields(args: argparse.Namespace, rows: list[Row], layout: Any) -> dict[str, Any]:
    """What `docs/benchmarks.md` shows of a run (`bench.results_page`): its name, title,
    command and table of p50 latencies."""
    cmd = (f"splitserve bench transfer --device {args.device}"
           + (" --handoffs" if args.handoffs else "")
           + f" --handoff-tokens {args.handoff_tokens}"
           + (f" --handoff-transports {args.handoff_transports}"
              if args.handoff_transports else "")
           + (f" --layout {args.layout}" if args.layout else "")
           + f" --repeats {args.repeats} --json transfer.json")
    sizes = sorted({r.tokens for r in rows})
    table = ["| transport | blocks | " + " | ".join(f"{n} tok" for n in sizes) + " |",
             "|---|---|" + "---|" * len(sizes)]
    for transport in dict.fromkeys(r.transport for r in rows):
        for mode in MODES:
            ms = {r.tokens: r.p50_ms for r in rows if (r.transport, r.mode) == (transport, mode)}
            table.append(f"| {transport} | {mode} | " + " | ".join(
                f"{ms[n]:.3f} ms" if n in ms else "-" for n in sizes) + " |")
    return {"name": "transfer-handoff", "command": cmd,
            "title": "KV hand-off between two processes on the host",
            "tables": [table],
            "notes": [f"{layout.name}, {layout.block_bytes // 1024} KiB blocks; one hand-off "
                      f"at a time, p50 of {args.repeats}; a scattered hand-off is one region "
                      "per block. fixed_us: the smallest hand-off's latency beyond its bytes; "
                      "region_us: the largest hand-off scattered against contiguous, per "
                      "extra region; n/s: within the noise of the two medians."]}


def describe(device: str) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def plan(mode: str, nblocks: int, pool: int, rng: random.Random) -> list[int]:
    """Destination blocks: a run, or `nblocks` scattered so that no two are adjacent
    (each its own region, as after a decode's free list has been churned)."""
    if mode == "contiguous":
        start = rng.randrange(0, pool - nblocks)
        return list(range(start, start + nblocks))
    evens = rng.sample(range(0, pool, 2), nblocks)
    return evens


def measure_copy(device: str, layout: Any, pool: int, blocks: list[int],
                 repeats: int) -> dict[str, float]:
    """GB/s of the in-process gather-scatter at the largest hand-off, scattered."""
    import torch

    from kvtransfer.scatter_copy import scatter_copy

    bb = layout.block_bytes
    kv = torch.empty(pool * bb, dtype=torch.uint8, device=device).fill_(3)
    rng = random.Random(1)
    n = max(blocks)
    out: dict[str, float] = {}
    for mode in MODES:
        secs = []
        for _ in range(repeats + 1):
            dst = plan(mode, n, pool, rng)
            regions = [(((i + 1) % pool) * bb, d * bb, bb) for i, d in enumerate(dst)]
            t0 = time.perf_counter()
            if device.startswith("cuda"):
                scatter_copy(kv, kv, regions)
                torch.cuda.synchronize(device)
            else:
                for s, d, k in regions:
                    kv[d:d + k].copy_(kv[s:s + k])
            secs.append(time.perf_counter() - t0)
        out[f"{mode}_gbps"] = n * bb / sorted(secs[1:])[len(secs[1:]) // 2] / 1e9
    out["gbps"] = out["scattered_gbps"]
    if device.startswith("cuda"):
        out["block_copy_gbps"] = block_copy_gbps(device, layout, pool, n, repeats)
    return out


def block_copy_gbps(device: str, layout: Any, pool: int, n: int, repeats: int) -> float:
    """GB/s of cuda_ipc's block copy kernel (every layer of n scattered blocks in one
    launch, kvtransfer/copy_kernel.py) inside one cache, launch to completion."""
    import torch

    from kvtransfer.copy_kernel import BlockCopy, layer_views

    kv = torch.empty(layout.tensor_shape(pool), dtype=torch.bfloat16, device=device)
    kv.view(-1).view(torch.uint8).fill_(3)
    copy = BlockCopy(layer_views(kv, layout), layer_views(kv, layout))
    rng = random.Random(2)
    secs = []
    for _ in range(repeats + 1):
        dst = plan("scattered", n, pool, rng)
        src = [(i + 1) % pool for i in range(n)]
        t0 = time.perf_counter()
        copy(src, dst)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        secs.append(time.perf_counter() - t0)
    return n * layout.block_bytes / sorted(secs[1:])[len(secs[1:]) // 2] / 1e9


def _config(transport: str) -> Any:
    from kvtransfer import TransferConfig

    return TransferConfig(transport=transport, token="bench-token", io_timeout_s=60.0,
                          lease_s=120.0, heartbeat_s=1.0, liveness_timeout_s=30.0)


async def bench(transport: str, device: str, layout: Any, pool: int, tokens: list[int],
                repeats: int) -> list[Row]:
    from kvtransfer import Region

    receiver = await open_receiver(transport, device, layout, pool)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=sender_main, daemon=True,
                       args=(child, transport, device, asdict(layout), pool,
                             receiver.address()))
    proc.start()
    rows: list[Row] = []
    rng = random.Random(7)
    loop = asyncio.get_running_loop()
    try:
        await _recv(loop, conn)
        for t in [tokens[0]] + tokens:  # the first size twice: warm-up, not reported
            nblocks = -(-t // layout.block_size)
            for mode in MODES:
                times = []
                for i in range(repeats):
                    dst = plan(mode, nblocks, pool, rng)
                    src = list(range(i % 2 * (pool - nblocks), i % 2 * (pool - nblocks)
                                     + nblocks))
                    xfer = f"{transport}-{t}-{mode}-{i}-{len(rows)}"
                    landed = receiver.expect(xfer, [Region(b) for b in dst], 1)
                    conn.send(("handoff", xfer, src, dst))
                    reply = await _recv(loop, conn)
                    if reply[0] != "done":
                        raise RuntimeError(f"{transport} sender: {reply[1]}")
                    await asyncio.wait_for(landed, 60)
                    times.append(reply[1])
                p50 = sorted(times)[len(times) // 2]
                rows.append(Row(transport, mode, t, nblocks * layout.block_bytes, repeats,
                                p50 * 1e3, nblocks * layout.block_bytes / p50 / 1e9,
                                iqr_ms(times)))
                print(f"  {_fmt(rows[-1])}", flush=True)
        conn.send(("stop",))
        proc.join(30)
        return rows[2:]  # minus the warm-up rows
    finally:
        if proc.is_alive():
            proc.kill()
        await receiver.close()


async def open_receiver(transport: str, device: str, layout: Any, pool: int) -> Any:
    """A started receiver of `transport` over a zeroed `pool`-block cache (shm: in a
    shared-memory segment its `close()` unlinks)."""
    import torch

    from kvtransfer import make_receiver

    receiver = make_receiver(_config(transport))
    if transport == "shm":
        receiver.allocate(layout, pool)  # type: ignore[attr-defined]
    else:
        receiver.register(torch.zeros(layout.tensor_shape(pool), dtype=torch.bfloat16,
                                      device=device), layout)
    await receiver.start()
    return receiver


async def _recv(loop: asyncio.AbstractEventLoop, conn: Connection) -> Any:
    def wait() -> Any:
        if not conn.poll(300):
            raise TimeoutError("benchmark sender did not answer")
        return conn.recv()

    return await loop.run_in_executor(None, wait)


def sender_main(conn: Connection, transport: str, device: str, layout_kw: dict[str, Any],
                pool: int, address: str) -> None:
    asyncio.run(_sender(conn, transport, device, layout_kw, pool, address))


async def _sender(conn: Connection, transport: str, device: str, layout_kw: dict[str, Any],
                  pool: int, address: str) -> None:
    sender, peer = await open_sender(transport, device, layout_kw, pool, address)
    loop = asyncio.get_running_loop()
    conn.send(("ready",))
    try:
        while (msg := await loop.run_in_executor(None, conn.recv))[0] != "stop":
            _, xfer, src, dst = msg
            conn.send(("done", await handoff(sender, peer, xfer, src, dst)))
    except Exception as e:  # report, then exit: the parent raises it
        conn.send(("error", repr(e)))
    finally:
        await sender.close()


async def open_sender(transport: str, device: str, layout_kw: dict[str, Any], pool: int,
                      address: str) -> tuple[Any, Any]:
    """A sender over a `pool`-block cache (every byte 7), connected to the receiver at
    `address`: (sender, peer); the caller closes the sender."""
    import torch

    from kvtransfer import KVLayout, make_sender

    layout = KVLayout(**layout_kw)
    sender = make_sender(_config(transport))
    kv = torch.empty(layout.tensor_shape(pool), dtype=torch.bfloat16, device=device)
    kv.view(-1).view(torch.uint8).fill_(7)
    sender.register(kv, layout)
    try:
        return sender, await sender.connect(address)
    except BaseException:
        await sender.close()
        raise


async def handoff(sender: Any, peer: Any, xfer: str, src: list[int], dst: list[int],
                  chunks: int = 1, begin: bool = True) -> float:
    """Writes blocks `src` into the receiver's `dst` in `chunks` writes (a chunked
    prefill's), then waits for the verdict; returns the seconds from the first write to
    the verdict. The transfer is begun first (`begin=False`: the caller did): an
    in-place transport's grant, whose round trip a worker runs beside the prefill's
    first chunk, off the path timed here."""
    from kvtransfer.layout import whole_blocks

    if begin:
        await sender.begin(peer, whole_blocks(dst), xfer, 1)
    per = -(-len(src) // max(1, chunks))
    t0 = time.perf_counter()
    for i in range(0, len(src), per):
        await sender.write(peer, whole_blocks(src[i:i + per]), whole_blocks(dst[i:i + per]),
                           xfer, 1)
    await sender.finish(peer, xfer, timeout_s=60.0)
    return time.perf_counter() - t0


def summarize(rows: list[Row], copy: dict[str, float], tokens: list[int],
              block_size: int = 16) -> dict[str, Any]:
    summary: dict[str, Any] = {"copy_gbps": copy["gbps"]}
    for transport in sorted({r.transport for r in rows}):
        mine = {(r.mode, r.tokens): r for r in rows if r.transport == transport}
        big = mine[("scattered", max(tokens))]
        small = mine[("scattered", min(tokens))]
        summary[f"{transport}_gbps"] = big.gbps
        summary[f"{transport}_vs_copy"] = big.gbps / copy["gbps"]
        summary[f"{transport}_fixed_us"] = max(
            0.0, small.p50_ms * 1e3 - small.bytes / (big.gbps * 1e9) * 1e6)
        whole = mine[("contiguous", max(tokens))]
        regions = -(-max(tokens) // block_size)  # scattered: one per block
        if regions > 1:
            summary[f"{transport}_region_us"] = region_us(big, whole, regions)
        if transport in TARGETS:
            summary[f"{transport}_target_met"] = big.gbps / copy["gbps"] >= TARGETS[transport]
        if transport in FIXED_TARGETS_US:
            summary[f"{transport}_fixed_target_met"] = \
                summary[f"{transport}_fixed_us"] <= FIXED_TARGETS_US[transport]
    return summary


def iqr_ms(times: list[float]) -> float:
    """Interquartile range of hand-off times in seconds, in ms (0 under 2 samples)."""
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) * 1e3


def region_us(scattered: Row, contiguous: Row, regions: int) -> float | None:
    """µs one more region costs: the scattered hand-off's excess over the contiguous one
    per extra region; None (not significant) when the excess is within twice the noise
    of the difference of the two medians (each median's standard error taken from its
    interquartile range: sigma ~ IQR / 1.349, se ~ 1.253 sigma / sqrt(n))."""
    excess = scattered.p50_ms - contiguous.p50_ms
    se = [1.253 * r.iqr_ms / 1.349 / max(r.handoffs, 1) ** 0.5
          for r in (scattered, contiguous)]
    if excess <= 2 * (se[0] ** 2 + se[1] ** 2) ** 0.5:
        return None
    return excess * 1e3 / (regions - 1)


def _fmt(r: Row) -> str:
    return (f"{r.transport:<8} {r.mode:<10} {r.tokens:>6} tok {r.bytes / 2**20:>8.1f} MiB "
            f"{r.p50_ms:>9.3f} ms {r.gbps:>8.2f} GB/s")


def report(rows: list[Row], copy: dict[str, float], summary: dict[str, Any],
           layout: Any) -> None:
    print(f"\n{layout.name}: block {layout.block_bytes / 2**20:.3f} MiB, "
          f"{layout.token_bytes} bytes per token; one hand-off at a time, p50")
    for r in rows:
        print(_fmt(r))
    print(f"\nin-process gather-scatter: contiguous {copy['contiguous_gbps']:.1f} GB/s, "
          f"scattered {copy['scattered_gbps']:.1f} GB/s")
    if "block_copy_gbps" in copy:
        print(f"cuda_ipc's block copy kernel in-process, scattered: "
              f"{copy['block_copy_gbps']:.1f} GB/s")
    for key, value in summary.items():
        text = "n/s (within noise)" if value is None else \
            f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{key:<22} {text}")
