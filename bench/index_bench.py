"""`splitserve bench index`: the gateway's block-index lookup against a real redis-server,
the server-side walk (RedisBlockIndex.lookup, one Lua script) next to the client-side
HGETALL walk it replaced (kvtransfer/index_pywalk.py), in the same run on the same data.

The index is filled as a cluster at scale sees it: every worker holds a shared prefix
(a system prompt, `--shared-blocks`) and a private run after it (its own conversation,
`--private-blocks`); every 8th worker has offloaded the prefix's last blocks to host
memory. Each lookup asks, for all workers, about the shared prefix, one worker's private
run and `--new-blocks` blocks nobody holds (the request's new turn), the gateway's
question. Figures per worker count, for both walks: wall time per lookup (p50, mean),
the gateway process's CPU time per lookup, and Redis's time in the walk's commands per
lookup (INFO commandstats: HGETALL for the Python walk, EVALSHA for the Lua one, over a
separate pass of `--lookups` / 4); and old / new (wall p50). Both walks must answer
the same, or the bench fails.

Ownership: the bench owns the redis-server it starts (killed before it returns); with
`--redis URL` it flushes nothing and writes only under its own model name's keys.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import socket
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass

from cluster.launcher import free_port
from engine.block_hash import BlockHash, hash_blocks, make_extra_key
from kvtransfer.index import IndexConfig, IndexLookup, RedisBlockIndex
from kvtransfer.index_pywalk import python_walk

BLOCK = 16  # tokens per block (the hashes only need distinct token ids)


@dataclass(frozen=True, slots=True)
class Row:
    workers: int
    python_p50_ms: float
    python_mean_ms: float
    python_cpu_ms: float
    python_redis_ms: float
    lua_p50_ms: float
    lua_mean_ms: float
    lua_cpu_ms: float
    lua_redis_ms: float

    @property
    def ratio(self) -> float:
        return self.python_p50_ms / self.lua_p50_ms


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="8,64,512", help="worker counts, comma-separated")
    p.add_argument("--shared-blocks", type=int, default=30, help="blocks every worker holds")
    p.add_argument("--private-blocks", type=int, default=20,
                   help="blocks each worker holds after the shared ones")
    p.add_argument("--new-blocks", type=int, default=10, help="blocks of a query nobody holds")
    p.add_argument("--lookups", type=int, default=200, help="lookups per walk and count")
    p.add_argument("--redis", default=None, help="use this Redis (default: start one)")
    p.add_argument("--json", default=None, help="write every row here")
    p.add_argument("--quick", action="store_true", help="8 and 32 workers, 10 lookups")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.workers, args.lookups = "8,32", 10
    counts = [int(w) for w in args.workers.split(",")]
    if min(counts) < 1 or min(args.shared_blocks, args.lookups) < 1 or min(
            args.private_blocks, args.new_blocks) < 0:
        raise SystemExit("--workers, --shared-blocks and --lookups must be >= 1, "
                         "--private-blocks and --new-blocks >= 0")
    with redis_url(args.redis) as url:
        rows = asyncio.run(measure_all(url, counts, args))
    print(f"block index lookup, {args.shared_blocks} shared + {args.private_blocks} private "
          f"+ {args.new_blocks} new blocks, {args.lookups} lookups per walk "
          "(wall p50 / mean, gateway CPU, redis time; ms per lookup)")
    print(f"{'workers':>8}  {'python walk':>31}  {'lua walk':>31}  {'python/lua':>10}")
    for r in rows:
        print(f"{r.workers:>8}  {r.python_p50_ms:7.3f} / {r.python_mean_ms:7.3f} / "
              f"{r.python_cpu_ms:7.3f} / {r.python_redis_ms:6.3f}  {r.lua_p50_ms:7.3f} / "
              f"{r.lua_mean_ms:7.3f} / {r.lua_cpu_ms:7.3f} / {r.lua_redis_ms:6.3f}  "
              f"{r.ratio:9.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"ratio": r.ratio} for r in rows], f, indent=2)
    return 0


@contextlib.contextmanager
def redis_url(url: str | None) -> Iterator[str]:
    """`url`, or a fresh redis-server on a free port (no persistence) for the block."""
    if url is not None:
        yield url
        return
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (make sysdeps), or pass --redis URL")
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10.0
        while True:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", port), timeout=0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"redis-server did not start on port {port}")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(5)


async def measure_all(url: str, counts: list[int], args: argparse.Namespace) -> list[Row]:
    rows = []
    for workers in counts:
        # one model name per count: the runs do not see each other's blocks
        idx = RedisBlockIndex(url, f"bench-index-{workers}", IndexConfig(timeout_ms=2000))
        try:
            queries = await fill(idx, workers, args)
            rows.append(await measure(idx, workers, queries, args.lookups))
        finally:
            keys = [k async for k in idx.client.scan_iter(match=f"kvidx:{idx.model}:*")]
            if keys:
                await idx.client.delete(*keys)
            await idx.close()
    return rows


async def fill(idx: RedisBlockIndex, workers: int, args: argparse.Namespace
               ) -> list[list[BlockHash]]:
    """Stores every worker's blocks; returns one query per worker."""
    extra = make_extra_key(idx.model)
    shared = hash_blocks(list(range(args.shared_blocks * BLOCK)), BLOCK, extra)
    queries = []
    for w in range(workers):
        node = f"worker-{w}"
        tail = hash_blocks(
            [1_000_000 * (w + 1) + t for t in range((args.private_blocks + args.new_blocks)
                                                    * BLOCK)], BLOCK, extra, parent=shared[-1])
        private = tail[:args.private_blocks]
        offloaded = set(shared[-4:]) if w % 8 == 7 else set()
        stored = [(h, "host" if h in offloaded else "device") for h in shared]
        stored += [(h, "device") for h in private]
        await idx.register(node, 1)
        await idx.apply(node, 1, stored=stored)
        queries.append(shared + tail)
    return queries


async def measure(idx: RedisBlockIndex, workers: int, queries: list[list[BlockHash]],
                  lookups: int) -> Row:
    allowed = frozenset(f"worker-{w}" for w in range(workers))

    async def lua(q: list[BlockHash]) -> IndexLookup:
        res = await idx.lookup(q, allowed)
        if res is None:
            raise SystemExit("the index did not answer (timeout?)")
        return res

    async def python(q: list[BlockHash]) -> IndexLookup:
        return (await python_walk(idx, q, allowed))[0]

    for q in queries[:3]:  # warm-up (the script loads on its first NOSCRIPT), and agree
        if await lua(q) != await python(q):
            raise SystemExit("the server-side walk and the Python walk disagree")
    wall: dict[str, list[float]] = {"python": [], "lua": []}
    cpu = {"python": 0.0, "lua": 0.0}
    walks: dict[str, Callable[[list[BlockHash]], Awaitable[IndexLookup]]] = {
        "python": python, "lua": lua}
    for i in range(lookups):  # interleaved: both see the same machine's noise
        q = queries[i % len(queries)]
        for name, walk in walks.items():
            c0, t0 = time.process_time(), time.perf_counter()
            await walk(q)
            wall[name].append(time.perf_counter() - t0)
            cpu[name] += time.process_time() - c0
    redis_ms = {}
    for (name, walk), command in zip(walks.items(), ("hgetall", "evalsha"), strict=True):
        # apart from the timed pass: a script's own HGETALLs count under HGETALL too
        n = max(1, lookups // 4)
        await idx.client.config_resetstat()
        for i in range(n):
            await walk(queries[i % len(queries)])
        stats = await idx.client.info("commandstats")
        redis_ms[name] = stats[f"cmdstat_{command}"]["usec"] / n / 1000.0
    ms = 1000.0
    return Row(workers,
               statistics.median(wall["python"]) * ms, statistics.fmean(wall["python"]) * ms,
               cpu["python"] / lookups * ms, redis_ms["python"],
               statistics.median(wall["lua"]) * ms, statistics.fmean(wall["lua"]) * ms,
               cpu["lua"] / lookups * ms, redis_ms["lua"])
