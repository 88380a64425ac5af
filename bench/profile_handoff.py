"""`bench profile`'s hand-off part: one scattered prompt handed off between two processes
(bench/transfer_handoff.py's receiver here and sender spawned), profiled on both sides.

The bench opens `record_function` ranges on its own sender and receiver instances
(instance attributes shadow the methods; nothing in kvtransfer changes, so they cost
nothing outside this bench):

    sender:   kv.begin > wire.RESERVE (in-place transports: the transfer's grant);
              handoff > kv.write (one chunk) > kv.send_regions > kv.copy, wire.WRITTEN
              (in-place transports), wire.WRITE (tcp: its regions and their bytes, one
              frame per chunk);  kv.finish (a FINISH only where nothing was written)
    receiver: handoff > rx.reserve, rx.written (in-place transports), rx.write (tcp)

The grant's RESERVE waits for its GRANT, before the hand-off's range (a worker asks as
the prefill call arrives, beside the first chunk's compute; `grant_us`); `kv.finish`
waits for the verdict (sent unasked to every writer: tcp's WRITE frames, an in-place
transport's grant make the sender one). A RESERVE inside a chunk would be a round trip
per chunk; a WRITTEN notice is sent without waiting. (ucx's puts end in flushes, a
round trip each inside its copy, below the frames counted here.)
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

from bench import profile_trace as pt
from bench.transfer_handoff import _recv, handoff, open_receiver, open_sender, plan

WARMUP = 2  # hand-offs before the profiled ones (connections, first-touch pages)
RX_RANGES = {"_on_reserve": "rx.reserve", "_on_written": "rx.written", "_on_write": "rx.write"}


def activities(device: str) -> list[Any]:
    from torch.profiler import ProfilerActivity

    cuda = device.startswith("cuda")
    return [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]


def ranged(obj: Any, attr: str, name: Callable[..., str]) -> None:
    """Wraps the coroutine method `obj.attr` (on this instance) in a profiler range
    named `name(*args)`."""
    from torch.profiler import record_function

    fn = getattr(obj, attr)

    async def wrapper(*a: Any, **kw: Any) -> Any:
        with record_function(name(*a)):
            return await fn(*a, **kw)

    setattr(obj, attr, wrapper)


def _frame_name(peer: Any, data: Any) -> str:
    from kvtransfer.wire import Frame

    try:
        return f"wire.{Frame(data[0]).name}"
    except ValueError:
        return "wire.frame"


def annotate_sender(sender: Any) -> None:
    for attr, name in (("write", "kv.write"), ("finish", "kv.finish"), ("begin", "kv.begin"),
                       ("_send_regions", "kv.send_regions"), ("_copy", "kv.copy"),
                       ("_send_write", "wire.WRITE")):
        if hasattr(sender, attr):
            ranged(sender, attr, lambda *a, n=name: n)
    ranged(sender, "_send_frame", _frame_name)


def sender_main(conn: Connection, transport: str, device: str, layout_kw: dict[str, Any],
                pool: int, address: str, chunks: int) -> None:
    asyncio.run(_sender(conn, transport, device, layout_kw, pool, address, chunks))


async def _sender(conn: Connection, transport: str, device: str, layout_kw: dict[str, Any],
                  pool: int, address: str, chunks: int) -> None:
    """transfer_handoff's sender loop, with ("profile", "start") and ("profile", "stop",
    trace path) around the profiled hand-offs."""
    from torch.profiler import profile, record_function

    from kvtransfer.layout import whole_blocks

    sender, peer = await open_sender(transport, device, layout_kw, pool, address)
    annotate_sender(sender)
    loop = asyncio.get_running_loop()
    conn.send(("ready",))
    prof: Any = None
    try:
        while (msg := await loop.run_in_executor(None, conn.recv))[0] != "stop":
            if msg[0] == "profile":
                if msg[1] == "start":
                    prof = profile(activities=activities(device))
                    prof.start()
                else:
                    prof.stop()
                    prof.export_chrome_trace(msg[2])
                conn.send(("ok",))
                continue
            _, xfer, src, dst = msg
            await sender.begin(peer, whole_blocks(dst), xfer, 1)
            with record_function("handoff"):
                seconds = await handoff(sender, peer, xfer, src, dst, chunks, begin=False)
            conn.send(("done", seconds))
    except Exception as e:  # report, then exit: the parent raises it
        conn.send(("error", repr(e)))
    finally:
        await sender.close()


async def profile_transport(transport: str, device: str, layout: Any, tokens: int,
                            chunks: int, repeats: int, trace_dir: str) -> dict[str, Any]:
    """Profiles `repeats` hand-offs of `tokens` scattered tokens in `chunks` writes over
    `transport`; returns the sender's and receiver's figures and trace paths."""
    from torch.profiler import profile, record_function

    from kvtransfer import Region

    nblocks = -(-tokens // layout.block_size)
    pool = 2 * nblocks + 8
    traces = {side: os.path.abspath(os.path.join(trace_dir, f"handoff-{transport}-{side}.json"))
              for side in ("sender", "receiver")}
    receiver = await open_receiver(transport, device, layout, pool)
    for attr, name in RX_RANGES.items():
        ranged(receiver, attr, lambda *a, n=name: n)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=sender_main, daemon=True,
                       args=(child, transport, device, asdict(layout), pool,
                             receiver.address(), chunks))
    proc.start()
    loop = asyncio.get_running_loop()
    rng = random.Random(7)

    async def ask(*msg: Any) -> Any:
        conn.send(msg)
        reply = await _recv(loop, conn)
        if reply[0] == "error":
            raise RuntimeError(f"{transport} sender: {reply[1]}")
        return reply

    async def one(i: int) -> None:
        dst = plan("scattered", nblocks, pool, rng)
        src = list(range(i % 2 * (pool - nblocks), i % 2 * (pool - nblocks) + nblocks))
        xfer = f"profile-{transport}-{i}"
        landed = receiver.expect(xfer, [Region(b) for b in dst], 1)
        await ask("handoff", xfer, src, dst)
        await asyncio.wait_for(landed, 60)

    try:
        if (await _recv(loop, conn))[0] != "ready":
            raise RuntimeError(f"{transport} sender did not start")
        for i in range(WARMUP):
            await one(i)
        await ask("profile", "start")
        with profile(activities=activities(device)) as prof:
            for i in range(WARMUP, WARMUP + repeats):
                with record_function("handoff"):
                    await one(i)
        await ask("profile", "stop", traces["sender"])
        prof.export_chrome_trace(traces["receiver"])
        conn.send(("stop",))
        await loop.run_in_executor(None, proc.join, 30)
    finally:
        if proc.is_alive():
            proc.kill()
        conn.close()
        child.close()
        await receiver.close()
    events = pt.load(traces["sender"])
    return {"transport": transport, "tokens": tokens, "blocks": nblocks,
            "chunks_asked": chunks,
            "sender": {**pt.handoff_figures(events, pt.DeviceWork(events),
                                            nblocks * layout.block_bytes),
                       "grant_us": pt.mean_us(events, "kv.begin")},
            "receiver": pt.receiver_figures(pt.load(traces["receiver"]), RX_RANGES.values()),
            "traces": traces}


def profile_handoffs(transports: list[str], device: str, layout: Any, tokens: int,
                     chunks: int, repeats: int, trace_dir: str) -> dict[str, Any]:
    return {t: asyncio.run(profile_transport(t, device, layout, tokens, chunks, repeats,
                                             trace_dir)) for t in transports}
