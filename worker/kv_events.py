"""Publishes a node's KV blocks to the Redis block index (kvtransfer/index.py).

Producers call `publish(stored=[(hash, tier)], removed=[(hash, tier)])` from any thread:
the engine's block pool through `on_engine_events` (tier "device"), the offload tiers
(host, disk, ...) directly. Operations queue in order (bounded) and a background task
sends them every `interval_s` as atomic batches.

Recovery: each tier registers a snapshot source (its full set of held hashes). The
publisher resyncs (writes every tier's snapshot under an epoch, then registers that
epoch) when it starts, when it had to drop queued operations, when Redis lost its
registration (a Redis restart: the batch's epoch check fails, or the periodic probe
sees no epoch), and, under the same epoch, every `refresh_s` to refresh TTLs. A resync
after lost operations takes a new epoch, which hides whatever the index held before.

Ownership: the publisher owns its RedisBlockIndex and its task (`start`/`close`); it
borrows the engine only through the snapshot source and the sink.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric

from engine.block_hash import BlockHash
from engine.block_pool import BlockRemoved, BlockStored, KVEvent
from kvtransfer.index import (
    IndexLookup,
    IndexUnavailable,
    RedisBlockIndex,
    TierEntry,
    check_tier,
    new_epoch,
)

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM
    from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

DEVICE = "device"

# `source(drop_pending)` returns every hash the tier holds. It must call
# `drop_pending()` atomically with taking that set (e.g. on the thread that publishes the
# tier's events), so queued operations older than the snapshot are discarded.
SnapshotSource = Callable[[Callable[[], None]], Awaitable[Sequence[BlockHash]]]
_Op = tuple[bool, BlockHash, str]  # (store?, hash, tier)


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    interval_s: float = 0.05  # batching window
    batch_size: int = 512  # operations per Lua call
    max_pending: int = 65536  # queued operations; more are dropped (then: resync)
    probe_s: float = 1.0  # how often to check that Redis still holds our epoch
    refresh_s: float = 200.0  # full republish under the same epoch (TTL refresh)

    def __post_init__(self) -> None:
        if min(self.interval_s, self.probe_s, self.refresh_s) <= 0:
            raise ValueError("interval_s, probe_s and refresh_s must be positive")
        if self.batch_size < 1 or self.max_pending < 1:
            raise ValueError("batch_size and max_pending must be >= 1")


class KVEventPublisher:
    """A `CacheIndex` for one node: publish (any thread) and lookup (its event loop)."""

    def __init__(self, index: RedisBlockIndex, node: str,
                 config: PublisherConfig | None = None) -> None:
        if not node or "@" in node:
            raise ValueError(f"bad node id for the index: {node!r}")
        self.index = index
        self.node = node
        self.config = config or PublisherConfig()
        self.epoch = new_epoch()
        self._lock = threading.Lock()
        self._pending: deque[_Op] = deque()
        self._lost = False  # operations were dropped: resync under a new epoch
        self._synced = False  # our epoch is registered and our snapshot written
        self._sources: dict[str, SnapshotSource] = {}
        self._task: asyncio.Task[None] | None = None
        self._last_probe = self._last_refresh = time.monotonic()
        self.published = self.dropped = self.resyncs = 0

    # -- producers (any thread) ------------------------------------------------------------
    def publish(self, stored: Sequence[TierEntry] = (),
                removed: Sequence[TierEntry] = ()) -> None:
        """Queues stores, then removals (call twice when a removal must come first)."""
        ops = [(True, h, check_tier(t)) for h, t in stored]
        ops += [(False, h, check_tier(t)) for h, t in removed]
        self._queue(ops)

    def on_engine_events(self, events: list[KVEvent]) -> None:
        """The engine's sink (AsyncLLM.set_kv_event_sink): device-tier events, in order."""
        ops: list[_Op] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                ops += [(True, h, DEVICE) for h in ev.block_hashes]
            elif isinstance(ev, BlockRemoved):
                ops += [(False, h, DEVICE) for h in ev.block_hashes]
        self._queue(ops)

    def _queue(self, ops: list[_Op]) -> None:
        with self._lock:
            room = self.config.max_pending - len(self._pending)
            if len(ops) > room:
                self.dropped += len(ops) - max(room, 0)
                self._lost = True
                ops = ops[:max(room, 0)]
            self._pending.extend(ops)

    def _drop_pending(self, tier: str) -> None:
        with self._lock:
            self._pending = deque(op for op in self._pending if op[2] != tier)

    def add_snapshot_source(self, tier: str, source: SnapshotSource) -> None:
        """`tier`'s full state for resyncs; set before `start` (or a resync follows)."""
        self._sources[check_tier(tier)] = source
        self._synced = False

    # -- CacheIndex.lookup ------------------------------------------------------------------
    async def lookup(self, hashes: Sequence[BlockHash]) -> IndexLookup | None:
        return await self.index.lookup(hashes)

    # -- the background task ----------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.node}")

    async def close(self, retire: bool = True) -> None:
        """Stops publishing; with `retire` this node's entries stop counting now."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if retire:
            with contextlib.suppress(IndexUnavailable):
                await self.index.retire(self.node, self.epoch)
        await self.index.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except IndexUnavailable as e:
                log.debug("kv index publish deferred: %s", e)
            except Exception:  # advisory: a bug here must not kill the worker
                log.exception("kv index publisher step failed")
            await asyncio.sleep(self.config.interval_s)

    async def step(self) -> None:
        """One round: resync if needed, send queued batches, probe now and then.
        Raises IndexUnavailable (the caller retries next round)."""
        now = time.monotonic()
        if self._lost or not self._synced:
            await self.resync(new=self._lost or self.resyncs > 0)
        elif now - self._last_refresh >= self.config.refresh_s:
            await self.resync(new=False)
        await self.flush()
        if now - self._last_probe >= self.config.probe_s:
            self._last_probe = now
            if await self.index.registered_epoch(self.node) != self.epoch:
                log.info("event=index_epoch_lost node=%s epoch=%d", self.node, self.epoch)
                self._synced = False

    async def flush(self) -> None:
        """Sends queued operations in order; an op leaves the queue once applied."""
        while True:
            with self._lock:
                batch = [self._pending[i] for i in
                         range(min(self.config.batch_size, len(self._pending)))]
            if not batch:
                return
            if not await self.index.apply(self.node, self.epoch, ordered=batch):
                self._synced = False  # Redis forgot our epoch (restart): resync first
                return
            with self._lock:
                for _ in batch:
                    self._pending.popleft()
            self.published += len(batch)

    async def resync(self, new: bool) -> None:
        """Writes every tier's full state under our epoch (a new one if `new`), then
        registers the epoch: readers switch from the old state to the new one at once."""
        epoch = new_epoch(self.epoch) if new else self.epoch
        with self._lock:
            self._lost = False  # drops from now on are caught by the next resync
        entries: list[_Op] = []
        for tier, source in self._sources.items():
            hashes = await source(functools.partial(self._drop_pending, tier))
            entries += [(True, h, tier) for h in hashes]
        try:
            for i in range(0, len(entries), self.config.batch_size):
                chunk = entries[i:i + self.config.batch_size]
                await self.index.apply(self.node, epoch, ordered=chunk, check=False)
            if not await self.index.register(self.node, epoch):
                log.warning("event=index_epoch_superseded node=%s epoch=%d", self.node, epoch)
                self._lost = True
                return
        except BaseException:
            with self._lock:
                self._lost = self._lost or new  # still owe a resync under a new epoch
            raise
        self.epoch, self._synced = epoch, True
        self._last_refresh = time.monotonic()
        self.resyncs += 1
        log.info("event=index_resync node=%s epoch=%d blocks=%d", self.node, epoch,
                 len(entries))


def engine_snapshot_source(llm: AsyncLLM) -> SnapshotSource:
    """The device tier's snapshot, read on the engine thread (`AsyncLLM.call`),
    atomically with discarding the queued events that snapshot already covers."""

    async def snapshot(drop_pending: Callable[[], None]) -> Sequence[BlockHash]:
        def take(engine: LLMEngine) -> list[BlockHash]:
            engine.kv.pool.take_events()  # not forwarded yet; the snapshot covers them
            drop_pending()
            return engine.kv.pool.cached_hashes()
        return await llm.call(take)

    return snapshot


class PublisherCollector:
    """The publisher's counters for a Prometheus registry (read at scrape time)."""

    def __init__(self, pub: KVEventPublisher) -> None:
        self.pub = pub

    def collect(self) -> Iterator[Metric]:
        p = self.pub
        for name, doc, value in (
                ("splitserve:index_published_ops", "Block index stores/removals sent",
                 p.published),
                ("splitserve:index_dropped_ops", "Block index operations dropped (queue "
                 "full while Redis was away; a resync follows)", p.dropped),
                ("splitserve:index_resyncs", "Full republishes of this node's blocks",
                 p.resyncs)):
            yield CounterMetricFamily(name, doc, value=value)


def start_kv_publisher(redis_url: str | None, model: str, node: str, llm: AsyncLLM,
                       timeout_s: float, registry: CollectorRegistry | None = None,
                       ) -> KVEventPublisher | None:
    """The worker's publisher (None without Redis): device events from `llm`, started,
    its counters in `registry`. Other tiers join with `add_snapshot_source` + `publish`;
    the caller `close()`s it."""
    if not redis_url:
        return None
    from kvtransfer.index import IndexConfig

    index = RedisBlockIndex(redis_url, model, IndexConfig(timeout_ms=int(timeout_s * 1000)))
    pub = KVEventPublisher(index, node)
    pub.add_snapshot_source(DEVICE, engine_snapshot_source(llm))
    llm.set_kv_event_sink(pub.on_engine_events)
    if registry is not None:
        registry.register(PublisherCollector(pub))
    pub.start()
    return pub
