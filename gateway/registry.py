"""The gateway's view of the workers: discovery (Redis and/or a static list), one
watcher per worker on its Load stream, and the routing snapshot.

Ownership: the registry owns one gRPC channel per worker (closed when the worker
leaves) and its watcher tasks. A worker is routable while its Load stream delivers
reports saying `ready` and the last one is younger than `load_stale_s`; a broken
stream takes it out at once and the watcher retries with capped exponential backoff.
When Redis is unreachable the last known Redis set is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import redis.asyncio as aioredis

from gateway.config import GatewayConfig
from gateway.routing.base import Candidate
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

WORKER_KEY_PREFIX = "splitserve:workers"  # worker/registration.py writes these keys


@dataclass(slots=True)
class WorkerEntry:
    address: str
    source: str  # "static" | "redis"
    channel: grpc.aio.Channel
    stub: pb_grpc.WorkerStub
    worker_id: str = ""
    role: str = ""
    load: pb.LoadReport | None = None
    last_report: float = 0.0
    inflight: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def routable(self, now: float, stale_s: float) -> bool:
        return (self.load is not None and self.load.ready and bool(self.role)
                and now - self.last_report < stale_s)


class WorkerRegistry:
    def __init__(self, config: GatewayConfig,
                 on_info: Callable[[pb.InfoResponse], None] | None = None) -> None:
        """`on_info` sees every worker's Info (e.g. to learn its max_model_len)."""
        self.config = config
        self._on_info = on_info
        self._workers: dict[str, WorkerEntry] = {}  # by address
        self._redis_known: set[str] = set()
        self._missing_since: dict[str, float] = {}  # known address -> first missed
        self._redis = (aioredis.Redis.from_url(
            config.redis_url, socket_timeout=config.redis_timeout_s,
            socket_connect_timeout=config.redis_timeout_s, decode_responses=True)
            if config.redis_url else None)
        self._discovery: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        for addr in self.config.static_workers:
            self._add(addr, "static")
        await self._discover_once()
        self._discovery = asyncio.create_task(self._discover_loop())

    async def stop(self) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._discovery
        for addr in list(self._workers):
            await self._remove(addr)
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()

    # -- routing view ------------------------------------------------------------------
    def candidates(self) -> list[Candidate]:
        now = time.monotonic()
        out = []
        for w in self._workers.values():
            if not w.routable(now, self.config.load_stale_s):
                continue
            rep = w.load
            assert rep is not None
            out.append(Candidate(
                worker_id=w.worker_id, address=w.address, role=w.role, ready=True,
                num_waiting=rep.num_waiting, num_running=rep.num_running,
                kv_usage=rep.kv_usage, num_free_blocks=rep.num_free_blocks,
                num_blocks=rep.num_blocks, inflight=w.inflight))
        return out

    def recently_routable(self, within_s: float) -> bool:
        """Whether a serving worker that is not routable now reported load within the
        last `within_s` (marked failed after one broken call, reconnecting): worth a
        short wait, where a registry of long-gone workers is not."""
        since = time.monotonic() - within_s
        return any(w.role in ("decode", "colocated") and w.last_report >= since
                   for w in self._workers.values())

    def entry(self, address: str) -> WorkerEntry | None:
        return self._workers.get(address)

    def serving_workers(self) -> int:
        """Known decode and colocated workers (those that answered Info), routable or not."""
        return sum(w.role in ("decode", "colocated") for w in self._workers.values())

    def inflight_total(self) -> int:
        """Worker calls this gateway has open, on every known worker (routable or not)."""
        return sum(w.inflight for w in self._workers.values())

    def mark_failed(self, address: str) -> None:
        """A call to the worker failed: out of routing until its next load report."""
        w = self._workers.get(address)
        if w is not None:
            w.load = None
            if w.task is not None:  # restart the watcher so it reconnects now
                w.task.cancel()
                w.task = asyncio.create_task(self._watch(w))

    def snapshot(self) -> list[dict[str, object]]:
        now = time.monotonic()
        return [{"address": w.address, "worker_id": w.worker_id, "role": w.role,
                 "source": w.source, "routable": w.routable(now, self.config.load_stale_s),
                 "inflight": w.inflight}
                for w in self._workers.values()]

    # -- discovery ---------------------------------------------------------------------
    def _add(self, address: str, source: str) -> None:
        if address in self._workers:
            return
        channel = self.config.security.channel(address)  # every call signed
        w = WorkerEntry(address, source, channel, pb_grpc.WorkerStub(channel))
        w.task = asyncio.create_task(self._watch(w))
        self._workers[address] = w
        log.info("worker %s added (%s)", address, source)

    async def _remove(self, address: str) -> None:
        w = self._workers.pop(address, None)
        if w is None:
            return
        if w.task is not None:
            w.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await w.task
        await w.channel.close(grace=None)
        log.info("worker %s removed", address)
        self.changed.set()

    async def _redis_addresses(self) -> set[str] | None:
        """Addresses registered for our model; None when Redis did not answer."""
        assert self._redis is not None
        pattern = f"{WORKER_KEY_PREFIX}:{self.config.served_model_name}:*"
        try:
            async def scan() -> set[str]:
                assert self._redis is not None
                found = set()
                async for key in self._redis.scan_iter(match=pattern, count=100):
                    addr = await self._redis.hget(key, "address")
                    if addr:
                        found.add(str(addr))
                return found
            return await asyncio.wait_for(scan(), self.config.redis_timeout_s * 4)
        except (OSError, asyncio.TimeoutError, aioredis.RedisError) as e:
            log.warning("redis discovery failed (keeping %d known workers): %s",
                        len(self._redis_known), e)
            return None

    async def _discover_once(self) -> None:
        if self._redis is None:
            return
        found = await self._redis_addresses()
        if found is None:
            return
        for addr in found - self._redis_known:
            self._add(addr, "redis")
        now, kept = time.monotonic(), set()
        for addr in found:
            self._missing_since.pop(addr, None)
        for addr in self._redis_known - found:
            w = self._workers.get(addr)
            if w is None or w.source != "redis":
                continue
            # A restarted (empty) Redis looks as if every worker left: one whose Load
            # stream still says ready keeps routing for a grace period while it
            # re-registers. A drained or dead worker is not routable and goes at once.
            since = self._missing_since.setdefault(addr, now)
            if w.routable(now, self.config.load_stale_s) \
                    and now - since < self.config.redis_missing_grace_s:
                kept.add(addr)
                continue
            self._missing_since.pop(addr, None)
            await self._remove(addr)
        self._redis_known = found | kept

    async def _discover_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.discovery_interval_s)
            await self._discover_once()

    # -- watching one worker -------------------------------------------------------------
    async def _watch(self, w: WorkerEntry) -> None:
        backoff = 0.1
        while True:
            try:
                info = await w.stub.Info(pb.InfoRequest(),
                                         timeout=self.config.worker_rpc_timeout_s)
                w.worker_id, w.role = info.worker_id, info.role
                if self._on_info is not None:
                    self._on_info(info)
                # Long-lived stream: re-opened when its deadline passes.
                async for rep in w.stub.Load(pb.LoadRequest(), timeout=3600.0):
                    w.load, w.last_report = rep, time.monotonic()
                    backoff = 0.1
                    self.changed.set()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                if w.load is not None:
                    log.warning("worker %s (%s) lost: %s", w.address, w.worker_id,
                                e.code().name)
            w.load = None
            self.changed.set()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.retry_backoff_max_s)
