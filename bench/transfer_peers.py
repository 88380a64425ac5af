"""The two sides of `splitserve bench transfer`, each meant to run in its own process.

The parent runs the receiver (decode side) and drives rounds; a spawned child runs
the sender (prefill side). Per round the parent `expect`s a batch of transfers into
disjoint destination runs, then tells the child to write them one after another
(`write` + `finish` each, timed at the sender: that is the latency a prefill sees).
The raw-TCP reference uses the same split with plain blocking sockets.
"""

from __future__ import annotations

import asyncio
import socket
import time
from multiprocessing.connection import Connection
from typing import Any

# 16 KiB blocks: bfloat16, 4 layers x (K, V) x 8 tokens x 2 heads x 64 dims.
BENCH_LAYOUT: dict[str, Any] = dict(num_layers=4, num_kv_heads=2, head_dim=64, block_size=8,
                                    dtype="bfloat16")


def make_pool(num_blocks: int, fill: int) -> Any:
    """A KV tensor of `num_blocks`, every page touched (no page faults while timed)."""
    import torch

    from kvtransfer import KVLayout

    layout = KVLayout(**BENCH_LAYOUT)
    kv = torch.empty(layout.tensor_shape(num_blocks), dtype=torch.bfloat16)
    kv.view(-1).view(torch.uint8).fill_(fill)
    return kv


def sender_main(conn: Connection, config_kw: dict[str, Any], address: str,
                num_blocks: int) -> None:
    """Child entry point: connect, then run the rounds the parent sends until "stop"."""
    asyncio.run(_sender_loop(conn, config_kw, address, num_blocks))


async def _sender_loop(conn: Connection, config_kw: dict[str, Any], address: str,
                       num_blocks: int) -> None:
    from kvtransfer import KVLayout, Region, TransferConfig, make_sender

    layout = KVLayout(**BENCH_LAYOUT)
    sender = make_sender(TransferConfig(**config_kw))
    sender.register(make_pool(num_blocks, 7), layout)
    loop = asyncio.get_running_loop()
    peer = await sender.connect(address)
    conn.send(("ready",))
    try:
        while True:
            # The pipe is read off-loop so heartbeats and replies keep flowing meanwhile.
            msg = await loop.run_in_executor(None, conn.recv)
            if msg[0] == "stop":
                break
            _, xfers, nblocks = msg
            times = []
            for xfer_id, src, dst in xfers:
                t0 = time.perf_counter()
                await sender.begin(peer, [Region(dst, num_blocks=nblocks)], xfer_id, 1)
                await sender.write(peer, [Region(src, num_blocks=nblocks)],
                                   [Region(dst, num_blocks=nblocks)], xfer_id, 1)
                await sender.finish(peer, xfer_id, timeout_s=60.0)
                times.append(time.perf_counter() - t0)
            conn.send(("done", times))
    except Exception as e:  # report, then exit: the parent turns it into an error
        conn.send(("error", repr(e)))
    finally:
        await sender.close()


def raw_tcp_sender(port: int, total: int, chunk: int, buffer_bytes: int,
                   pool: int = 0) -> None:
    """Child entry point: stream `total` bytes to 127.0.0.1:port in `chunk` sendall calls,
    reading them from a `pool`-byte buffer in turn (out of cache, as a KV pool is)."""
    data = memoryview(bytearray(b"\x07" * max(pool, chunk)))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        _tune(sock, buffer_bytes)
        sent = off = 0
        while sent < total:
            n = min(chunk, total - sent)
            if off + n > len(data):
                off = 0
            sock.sendall(data[off:off + n])
            sent += n
            off += n
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # wait for the receiver's close so the last bytes are counted there


def raw_tcp_receive(listener: socket.socket, total: int, chunk: int,
                    buffer_bytes: int, pool: int = 0) -> float:
    """Accept one stream and read `total` bytes with recv_into, into a `pool`-byte buffer
    in turn (out of cache, as a KV pool is); returns seconds."""
    sock, _ = listener.accept()
    with sock:
        _tune(sock, buffer_bytes)
        buf = memoryview(bytearray(max(pool, chunk)))
        got, off, t0 = 0, 0, 0.0
        while got < total:
            if off + chunk > len(buf):
                off = 0
            k = sock.recv_into(buf[off:off + chunk])
            if k == 0:
                raise ConnectionError("raw TCP sender closed early")
            if got == 0:
                t0 = time.perf_counter()
            got += k
            off += k
        return time.perf_counter() - t0


def _tune(sock: socket.socket, buffer_bytes: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:  # 0: leave the kernel's autotuning on
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
