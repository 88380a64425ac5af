"""`splitserve bench transfer --prefill-tensor-parallel-size P
--decode-tensor-parallel-size D`: whole-prompt KV hand-offs from a TP P prefill engine
to a TP D decode engine by both paths a worker has, beside TP 1 -> TP 1, in one run.

Both sides are real engines (engine.llm.LLM over `--model DIR`, or `--model-shape S`
with random weights) with their ranks and process group (gloo on CPU, NCCL on CUDA).
Paths (the row's `path`):

- `rank`: each decode rank's heads move straight from the prefill rank holding them
  into its own cache (the transports register every rank's cache, `RankCaches`; what a
  CPU worker does). Not on CUDA (rank 0 cannot address its ranks' device caches).
- `staging`: the prefill's rank 0 gathers every rank's KV heads of the blocks into its
  full-head staging copy (`ModelRunner.gather_blocks`), the transport writes them into
  the decode's staging copy, whose rank 0 then scatters them to its ranks
  (`scatter_blocks`): what a CUDA worker does.
- `direct`: TP 1 -> TP 1, the transports read and write the caches themselves.

Source blocks are a run, destination blocks are scattered over the decode's pool. One
hand-off at a time, p50 of `--repeats`; the last of each size is checked (the decode's
ranks, read back, hold the sent bytes).

Per row: bytes, hand-off ms (gather + wire + scatter), GB/s, and the gather/scatter
share of the hand-off. Summary (`--json`): at the largest prompt, `tp_gbps` (the rank
path where there is one), `staging_gbps`, `rank_vs_staging`, `ref_gbps` (TP 1 -> TP 1),
`tp_vs_ref` and `tp_share`.

Placement on CUDA: the prefill's ranks on cuda:0..P-1, the decode's after them when
P + D GPUs are visible, else from cuda:0 as well (a group per process, sharing GPUs).
On CPU the figures are the mechanism's, not a GPU's: two cores running gloo ranks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any


@dataclass(frozen=True, slots=True)
class TPRow:
    prefill_tp: int
    decode_tp: int
    path: str  # rank, staging, direct (see the module doc)
    tokens: int
    bytes: int
    handoffs: int
    p50_ms: float
    gbps: float
    gather_ms: float
    wire_ms: float
    scatter_ms: float
    tp_share: float  # (gather + scatter) / hand-off, of the p50s


def add_arguments(p: argparse.ArgumentParser) -> None:
    from engine.cli import model_shape_arg

    g = p.add_argument_group("hand-offs between tensor-parallel sizes (bench/transfer_tp.py)")
    g.add_argument("--prefill-tensor-parallel-size", type=int, default=None, metavar="P",
                   help="the sending engine's TP size (with --decode-tensor-parallel-size: "
                        "hand-offs between real engines, beside TP 1 -> TP 1)")
    g.add_argument("--decode-tensor-parallel-size", type=int, default=None, metavar="D",
                   help="the receiving engine's TP size")
    g.add_argument("--model", default=None,
                   help="model directory for both engines (default: --model-shape)")
    g.add_argument("--model-shape", type=model_shape_arg, default=None,
                   help="known shape with random weights (default llama3-8b on cuda, "
                        "qwen3-0.6b on cpu)")
    g.add_argument("--tp-transport", default="tcp",
                   help="the transport between the two engines (tcp, ucx, ...)")


def wanted(args: argparse.Namespace) -> bool:
    return (getattr(args, "prefill_tensor_parallel_size", None) is not None
            or getattr(args, "decode_tensor_parallel_size", None) is not None)


def _check(args: argparse.Namespace) -> tuple[int, int, list[int]]:
    p, d = args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size
    p, d = 1 if p is None else p, 1 if d is None else d
    if p < 1 or d < 1:
        raise SystemExit(f"tensor-parallel sizes must be >= 1, got prefill {p}, decode {d}")
    if args.tp_transport == "shm":
        raise SystemExit("--tp-transport shm is not measured here (its segment is the "
                         "receiver's allocation); use tcp or ucx")
    try:
        tokens = [int(t) for t in args.handoff_tokens.split(",")]
    except ValueError:
        raise SystemExit(f"--handoff-tokens takes comma-separated integers, "
                         f"got {args.handoff_tokens!r}") from None
    if not tokens or min(tokens) < 1 or args.repeats < 1:
        raise SystemExit("--handoff-tokens and --repeats must be positive")
    return p, d, tokens


def _model(args: argparse.Namespace, cuda: bool) -> tuple[str, str]:
    """(model directory, load format)."""
    if args.model is not None:
        return args.model, "auto"
    from engine.model_shapes import model_shape_dir

    return model_shape_dir(args.model_shape or ("llama3-8b" if cuda else "qwen3-0.6b")), "dummy"


def _devices(device: str, p: int, d: int) -> tuple[str, str]:
    if not device.startswith("cuda"):
        return device, device
    import torch

    n = torch.cuda.device_count()
    if n < max(p, d):
        raise SystemExit(f"prefill TP {p} and decode TP {d} need {max(p, d)} GPUs; {n} visible")
    return "cuda:0", f"cuda:{p}" if n >= p + d else "cuda:0"


def run(args: argparse.Namespace) -> int:
    p, d, tokens = _check(args)
    cuda = args.device.startswith("cuda")
    model_dir, load_format = _model(args, cuda)
    runs = [(1, 1, "direct")]
    if (p, d) != (1, 1):
        runs += [(p, d, "staging")] + ([] if cuda else [(p, d, "rank")])
    rows: list[TPRow] = []
    layout = None
    for pp, dd, path in runs:
        got, layout = asyncio.run(bench_pair(pp, dd, args, model_dir, load_format, tokens,
                                             path))
        rows += got
    summary = summarize(rows, (p, d), tokens)
    report(rows, summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": [asdict(r) for r in rows],
                       "layout": asdict(layout) if layout is not None else None,
                       "device": args.device, "model": model_dir,
                       "transport": args.tp_transport, "prefill_tp": p, "decode_tp": d},
                      f, indent=2)
    return 0


def _engine(model_dir: str, load_format: str, device: str, tp: int, pool: int) -> Any:
    from engine.llm import LLM

    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return LLM(model_dir, dtype=dtype, block_size=16, num_blocks=pool, device=device,
               load_format=load_format, tensor_parallel_size=tp)


def _kv(llm: Any, path: str) -> Any:
    """What the transports register: the cache at TP 1, every rank's cache on the rank
    path, else rank 0's staging copy."""
    from kvtransfer.memory import RankCaches

    runner = llm.engine.runner
    if runner.tp is None:
        return runner.kv_cache
    return RankCaches(list(runner.rank_caches)) if path == "rank" else runner.staging()


async def bench_pair(p: int, d: int, args: argparse.Namespace, model_dir: str,
                     load_format: str, tokens: list[int], path: str = "staging",
                     ) -> tuple[list[TPRow], Any]:
    from bench.transfer_handoff import _config, _recv, plan
    from kvtransfer import Region, make_receiver
    from kvtransfer.layout import engine_layout

    send_dev, recv_dev = _devices(args.device, p, d)
    blocks = [-(-t // 16) for t in tokens]
    pool = 2 * max(blocks) + 8
    llm = _engine(model_dir, load_format, recv_dev, d, pool)
    receiver = None
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    # not a daemon: the sender's engine spawns its own ranks
    proc = ctx.Process(target=sender_main, args=(child, args.tp_transport, model_dir,
                                                 load_format, send_dev, p, pool, path))
    try:
        runner = llm.engine.runner
        layout = engine_layout(llm.engine.config)
        kv = _kv(llm, path)
        receiver = make_receiver(_config(args.tp_transport))
        receiver.register(kv, layout)
        await receiver.start()
        proc.start()
        loop = asyncio.get_running_loop()
        conn.send(("connect", receiver.address()))
        ready = await _recv(loop, conn)
        if ready[0] != "ready":
            raise RuntimeError(f"TP {p} sender: {ready[1]}")
        rng = random.Random(7)
        rows: list[TPRow] = []
        for t in [tokens[0]] + tokens:  # the first size twice: warm-up, not reported
            n = -(-t // 16)
            totals, gathers, wires, scatters = [], [], [], []
            for i in range(args.repeats):
                dst = plan("scattered", n, pool, rng)
                xfer = f"tp{p}-{d}-{t}-{i}-{len(rows)}"
                landed = receiver.expect(xfer, [Region(b) for b in dst], 1)
                conn.send(("handoff", xfer, list(range(n)), dst))
                reply = await _recv(loop, conn)
                if reply[0] != "done":
                    raise RuntimeError(f"TP {p} sender: {reply[1]}")
                await asyncio.wait_for(landed, 120)
                scatter = 0.0  # TP 1 / rank: the transport wrote the caches themselves
                if runner.tp is not None and path == "staging":
                    t0 = time.perf_counter()
                    runner.scatter_blocks(dst, kv)
                    if runner.device.type == "cuda":
                        import torch

                        torch.cuda.synchronize(runner.device)
                    scatter = time.perf_counter() - t0
                if i == args.repeats - 1:
                    _verify(runner, kv if runner.tp is None else runner.staging(), dst,
                            reply[3], p, d)
                gathers.append(reply[1])
                wires.append(reply[2])
                scatters.append(scatter)
                totals.append(reply[1] + reply[2] + scatter)
            rows.append(_row(p, d, path, t, n * layout.block_bytes, totals, gathers, wires,
                             scatters))
            print(f"  {_fmt(rows[-1])}", flush=True)
        conn.send(("stop",))
        proc.join(60)
        return rows[1:], layout
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        if receiver is not None:
            await receiver.close()
        llm.engine.runner.close()


def _verify(runner: Any, kv: Any, dst: list[int], expected: str, p: int, d: int) -> None:
    """The decode's ranks hold the prefill's blocks: read back from them (gathered on
    rank 0 at TP > 1), compared with the sender's checksum."""
    if runner.tp is not None:
        kv[dst] = 0
        runner.gather_blocks(dst, kv)
    got = _checksum(kv, dst)
    if got != expected:
        raise RuntimeError(f"TP {p} -> TP {d}: the landed blocks differ from the sent ones "
                           f"(digest {got}, sent {expected})")


def _p50(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _row(p: int, d: int, path: str, tokens: int, nbytes: int, totals: list[float],
         gathers: list[float], wires: list[float], scatters: list[float]) -> TPRow:
    total = _p50(totals)
    g, s = _p50(gathers), _p50(scatters)
    return TPRow(p, d, path, tokens, nbytes, len(totals), total * 1e3, nbytes / total / 1e9,
                 g * 1e3, _p50(wires) * 1e3, s * 1e3, min(1.0, (g + s) / total))


def sender_main(conn: Connection, transport: str, model_dir: str, load_format: str,
                device: str, tp: int, pool: int, path: str = "staging") -> None:
    try:
        llm = _engine(model_dir, load_format, device, tp, pool)
    except Exception as e:  # report, then exit: the parent raises it
        conn.send(("error", repr(e)))
        return
    try:
        asyncio.run(_sender(conn, transport, llm, path))
    finally:
        llm.engine.runner.close()


def _fill(runner: Any, kv: Any) -> None:
    """Random KV in every rank's heads of every block; rank 0's staging cleared after
    (so a hand-off's gather must fetch them)."""
    import torch

    with torch.inference_mode():
        if runner.tp is None:
            kv.uniform_(-1, 1)
            return
        kv.uniform_(-1, 1)
        runner.scatter_blocks(list(range(kv.shape[0])), kv)
        kv.zero_()


def _checksum(kv: Any, ids: list[int]) -> str:
    """Digest of blocks `ids`' bytes in order (the same blocks in another order, or
    misplaced heads, give another digest)."""
    import hashlib

    import torch

    data = kv[ids].contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


async def _sender(conn: Connection, transport: str, llm: Any, path: str) -> None:
    import torch

    from bench.transfer_handoff import _config
    from kvtransfer import make_sender
    from kvtransfer.layout import engine_layout, whole_blocks

    runner = llm.engine.runner
    staging = runner.kv_cache if runner.tp is None else runner.staging()
    _fill(runner, staging)
    kv = _kv(llm, path)
    sender = make_sender(_config(transport))
    sender.register(kv, engine_layout(llm.engine.config))
    loop = asyncio.get_running_loop()
    try:
        _, address = await loop.run_in_executor(None, conn.recv)
        peer = await sender.connect(address)
        conn.send(("ready",))
        while (msg := await loop.run_in_executor(None, conn.recv))[0] != "stop":
            _, xfer, src, dst = msg
            t0 = t1 = time.perf_counter()
            if runner.tp is not None and path == "staging":
                runner.gather_blocks(src, staging)
                t1 = time.perf_counter()
            await sender.begin(peer, whole_blocks(dst), xfer, 1)
            await sender.write(peer, whole_blocks(src), whole_blocks(dst), xfer, 1)
            await sender.finish(peer, xfer, timeout_s=120.0)
            if staging.device.type == "cuda":
                torch.cuda.synchronize(staging.device)
            wire = time.perf_counter() - t1
            if runner.tp is not None and path == "rank":  # the digest's full-head blocks
                runner.gather_blocks(src, staging)
            conn.send(("done", t1 - t0, wire, _checksum(staging, src)))
    except Exception as e:  # report, then exit: the parent raises it
        conn.send(("error", repr(e)))
    finally:
        await sender.close()


def summarize(rows: list[TPRow], pair: tuple[int, int], tokens: list[int]) -> dict[str, Any]:
    """At the largest prompt: the pair's rank path (else staging, else TP 1) beside
    its staging path and TP 1 -> TP 1."""
    big = max(tokens)
    at = {r.path: r for r in rows if r.tokens == big and (r.prefill_tp, r.decode_tp) in
          (pair, (1, 1))}
    ref = at["direct"]
    tp = at.get("rank") or at.get("staging") or ref
    staging = at.get("staging") or ref
    return {"prefill_tp": pair[0], "decode_tp": pair[1], "path": tp.path, "tokens": big,
            "bytes": tp.bytes, "tp_gbps": tp.gbps, "staging_gbps": staging.gbps,
            "rank_vs_staging": tp.gbps / staging.gbps, "ref_gbps": ref.gbps,
            "tp_vs_ref": tp.gbps / ref.gbps, "tp_share": tp.tp_share, "tp_p50_ms": tp.p50_ms,
            "ref_p50_ms": ref.p50_ms}


def _fmt(r: TPRow) -> str:
    return (f"TP {r.prefill_tp}->{r.decode_tp} {r.path:<7} {r.tokens:>6} tok {r.bytes / 2**20:>8.2f} MiB "
            f"{r.p50_ms:>9.3f} ms {r.gbps:>8.3f} GB/s  gather {r.gather_ms:.3f} ms "
            f"wire {r.wire_ms:.3f} ms scatter {r.scatter_ms:.3f} ms "
            f"(TP share {r.tp_share:.0%})")


def report(rows: list[TPRow], summary: dict[str, Any]) -> None:
    print("\none hand-off at a time, p50 (gather on the prefill's rank 0, the wire, "
          "scatter on the decode's rank 0)")
    for r in rows:
        print(_fmt(r))
    print(f"\nTP {summary['prefill_tp']} -> TP {summary['decode_tp']} at {summary['tokens']} "
          f"tokens: {summary['path']} {summary['tp_gbps']:.3f} GB/s vs staging "
          f"{summary['staging_gbps']:.3f} GB/s (ratio {summary['rank_vs_staging']:.2f}); "
          f"TP 1 -> TP 1 {summary['ref_gbps']:.3f} GB/s (ratio {summary['tp_vs_ref']:.2f}); "
          f"gather/scatter {summary['tp_share']:.0%} of the hand-off")
    for key, value in summary.items():
        print(f"{key:<12} {value:.3f}" if isinstance(value, float) else f"{key:<12} {value}")
