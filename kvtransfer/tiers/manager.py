"""TieredCache: a node's offload tiers (host DRAM -> local disk -> LMCache), best first.
It owns all mutable tier state and implements the engine's `KVOffload` hook.

Write path: `save` (engine thread) queues newly cached device blocks; a background
thread gathers their KV off the step loop, reports the device blocks free again
(`take_saved`), and stores the copies in the first tier. A full tier's LRU victims are
demoted to the next tier; the last tier's victims are dropped. Every store and
eviction goes to `publish(stored=[(hash, tier)], removed=[(hash, tier)])` when one is
wired (the index publisher), and to every listener added with `add_listener` (vLLM's
KV events wire); they are called from this cache's threads, so they must be
thread-safe and non-blocking.

Read path: `lookup` walks the tiers for the longest leading run (a run may continue
in another tier: blocks 0-3 on disk, 4-7 in host); `load` copies that run into the
engine's freshly allocated device blocks, counting hits and bytes per tier.

Sparing sole copies: `spare(hash) -> bool` (settable at run time; the worker sets
sparing.SoleCopyView, the index's view: True when no other node holds the block) makes eviction skip such blocks while
others can go; LRU order otherwise.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.block_hash import BlockHash
from kvtransfer.layout import KVLayout, engine_layout  # noqa: F401  (re-exported)
from kvtransfer.memory import torch_dtype
from kvtransfer.tiers.base import CacheTier, SpareFn, TierError
from kvtransfer.tiers.config import TierConfig
from kvtransfer.tiers.registry import make_tier

log = logging.getLogger(__name__)

TierEntry = tuple[BlockHash, str]
PublishFn = Callable[..., None]  # publish(stored=[...], removed=[...])


@dataclass(slots=True)
class TierStats:
    """Cumulative figures per tier name (blocks and bytes)."""

    hits: dict[str, int] = field(default_factory=dict)  # blocks loaded from the tier
    bytes_loaded: dict[str, int] = field(default_factory=dict)
    bytes_stored: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, int] = field(default_factory=dict)  # held now
    lookups: int = 0  # blocks asked for
    save_errors: int = 0

    def add(self, table: dict[str, int], tier: str, n: int) -> None:
        table[tier] = table.get(tier, 0) + n


@dataclass(slots=True)
class _SaveJob:
    hashes: list[BlockHash]
    block_ids: list[int]
    kv_cache: torch.Tensor
    ready: Any = None  # a CUDA event the copy waits for


class TieredCache:
    def __init__(self, config: TierConfig, layout: KVLayout,
                 publish: PublishFn | None = None, spare: SpareFn | None = None,
                 tiers: Sequence[CacheTier] | None = None) -> None:
        if tiers is None and not config.enabled:
            raise ValueError("TieredCache needs at least one enabled tier")
        self.config = config
        self.layout = layout
        self.publish = publish
        self._listeners: list[PublishFn] = []
        self.spare = spare
        self._lock = threading.RLock()
        self.tiers: list[CacheTier] = []
        try:
            for name in config.tiers if tiers is None else ():
                self.tiers.append(make_tier(name, config, layout))
        except BaseException:
            self.close()
            raise
        if tiers is not None:
            self.tiers = list(tiers)
        self._stats = TierStats()
        self._jobs: queue.Queue[_SaveJob | None] = queue.Queue()
        self._done: list[int] = []
        self._done_cv = threading.Condition(self._lock)
        self._pending = 0  # device blocks queued or being copied
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self.tiers]

    # -- read path (engine thread) -----------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        with self._lock:
            self._stats.lookups += len(hashes)
            return sum(n for _, n in self._plan(hashes))

    def _plan(self, hashes: Sequence[BlockHash]) -> list[tuple[CacheTier, int]]:
        """(tier, run length) covering the longest leading run, best tier first."""
        plan: list[tuple[CacheTier, int]] = []
        i = 0
        while i < len(hashes):
            for tier in self.tiers:
                n = tier.contains(hashes[i:])
                if n:
                    plan.append((tier, n))
                    i += n
                    break
            else:
                break
        return plan

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int],
             kv_cache: torch.Tensor) -> int:
        done = 0
        with self._lock:
            for tier, n in self._plan(hashes):
                dst = [kv_cache[b] for b in block_ids[done:done + n]]
                got = tier.get(hashes[done:done + n], dst)
                self._stats.add(self._stats.hits, tier.name, got)
                self._stats.add(self._stats.bytes_loaded, tier.name,
                                got * self.layout.block_bytes)
                done += got
                if got < n:  # corrupt or vanished: the rest is computed
                    break
        if kv_cache.is_cuda:  # host buffers may be reused by the save thread next
            torch.cuda.current_stream(kv_cache.device).synchronize()
        return done

    # -- write path --------------------------------------------------------------------
    def save(self, hashes: Sequence[BlockHash], block_ids: Sequence[int],
             kv_cache: torch.Tensor) -> list[int]:
        """Queues copies of blocks the first tier lacks (a block loaded from it is there).
        Returns the block ids queued; they come back from `take_saved` once read."""
        if self._closed or not self.tiers:
            return []
        first = self.tiers[0]
        with self._lock:
            todo = [(h, b) for h, b in zip(hashes, block_ids, strict=True)
                    if not first.contains([h])]
            room = self.config.save_queue_blocks - self._pending
            todo = todo[:max(room, 0)]  # a full queue drops saves: offload is best effort
            if not todo:
                return []
            self._pending += len(todo)
        job = _SaveJob([h for h, _ in todo], [b for _, b in todo], kv_cache)
        if kv_cache.is_cuda:
            job.ready = torch.cuda.Event()
            job.ready.record(torch.cuda.current_stream(kv_cache.device))
        self._ensure_thread()
        self._jobs.put(job)
        return job.block_ids

    def take_saved(self, timeout: float = 0.0) -> list[int]:
        with self._done_cv:
            if not self._done and self._pending and timeout > 0:
                self._done_cv.wait(timeout)
            done, self._done = self._done, []
            return done

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Waits until every queued save has landed in its tier (tests, shutdown)."""
        with self._done_cv:
            return self._done_cv.wait_for(lambda: self._pending == 0, timeout)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._save_loop, name="kv-offload",
                                            daemon=True)
            self._thread.start()

    def _save_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._run_save(job)
            except Exception as e:  # a tier failed: the blocks are simply not offloaded
                log.warning("offload of %d blocks failed: %s", len(job.hashes), e)
                with self._lock:
                    self._stats.save_errors += 1

    def _run_save(self, job: _SaveJob) -> None:
        ids = torch.tensor(job.block_ids, dtype=torch.long, device=job.kv_cache.device)
        if job.ready is not None:
            stream = torch.cuda.Stream(job.kv_cache.device)
            stream.wait_event(job.ready)
            with torch.cuda.stream(stream):
                copies = job.kv_cache.index_select(0, ids).to("cpu")
        else:
            copies = job.kv_cache.index_select(0, ids)
        with self._done_cv:  # the device blocks may be reused from here on
            self._done += job.block_ids
            self._done_cv.notify_all()
        try:
            self._store(0, job.hashes, list(copies.unbind(0)))
        finally:
            with self._done_cv:
                self._pending -= len(job.hashes)
                self._done_cv.notify_all()

    def put(self, hashes: Sequence[BlockHash], src: Sequence[torch.Tensor],
            tier: str | None = None) -> None:
        """Stores blocks directly (synchronously) in `tier` (default: the first)."""
        idx = 0 if tier is None else self.tier_names.index(tier)
        self._store(idx, list(hashes), list(src))

    def _store(self, idx: int, hashes: list[BlockHash], src: list[torch.Tensor]) -> None:
        """Puts blocks into tier `idx`, demoting its victims to tier idx + 1 first (in
        chunks of the tier's capacity, so a big batch never evicts its own blocks
        without demoting them)."""
        tier = self.tiers[idx]
        step = tier.capacity or len(hashes) or 1
        for i in range(0, len(hashes), step):
            with self._lock:
                self._store_chunk(idx, hashes[i:i + step], src[i:i + step])

    def _store_chunk(self, idx: int, hashes: list[BlockHash],
                     src: list[torch.Tensor]) -> None:
        tier = self.tiers[idx]
        new = [i for i, h in enumerate(hashes) if not tier.contains([h])]
        if tier.capacity and idx + 1 < len(self.tiers):
            over = len(tier) + len(new) - tier.capacity
            if over > 0:
                self._demote(idx, tier.victims(over, self.spare))
        evicted = tier.put(hashes, src, self.spare)
        self._stats.add(self._stats.bytes_stored, tier.name,
                        len(new) * self.layout.block_bytes)
        self._note_evicted(tier.name, evicted)
        self._publish([(hashes[i], tier.name) for i in new],
                      [(h, tier.name) for h in evicted])

    def _demote(self, idx: int, victims: list[BlockHash]) -> None:
        tier = self.tiers[idx]
        shape = self.layout.tensor_shape(1)[1:]
        bufs = [torch.empty(shape, dtype=torch_dtype(self.layout)) for _ in victims]
        got = sum(tier.get([h], [b]) for h, b in zip(victims, bufs, strict=True))
        if got < len(victims):
            raise TierError(f"tier {tier.name} lost blocks while demoting them")
        tier.evict(victims)
        self._note_evicted(tier.name, victims)
        self._publish([], [(h, tier.name) for h in victims])
        self._store(idx + 1, victims, bufs)

    def _note_evicted(self, tier: str, hashes: Sequence[BlockHash]) -> None:
        if hashes:
            self._stats.add(self._stats.evictions, tier, len(hashes))

    def _publish(self, stored: list[TierEntry], removed: list[TierEntry]) -> None:
        if not (stored or removed):
            return
        for fn in ([self.publish] if self.publish is not None else []) + self._listeners:
            try:
                fn(stored=stored, removed=removed)
            except Exception as e:  # the index and the event streams are advisory
                log.warning("tier event publish failed: %s", e)

    def add_listener(self, fn: PublishFn) -> None:
        """`fn(stored=[(hash, tier)], removed=[(hash, tier)])` gets every block held now
        as stored (a disk tier keeps blocks across restarts), then every later store and
        eviction, beside the index publisher (same threads, same rules)."""
        with self._lock:  # atomic with our publishes: nothing missed, nothing twice
            held = [(h, t.name) for t in self.tiers for h in t.hashes()]
            if held:
                fn(stored=held, removed=[])
            self._listeners.append(fn)

    def attach_publisher(self, publisher: Any) -> None:
        """Wires the index publisher (worker/kv_events.py KVEventPublisher): our stores and
        evictions go to its `publish`, and each tier becomes a snapshot source for its
        resyncs. Call before `publisher.start()` or expect a resync."""
        for tier in self.tiers:
            publisher.add_snapshot_source(tier.name, self._snapshot_source(tier))
        self.publish = publisher.publish

    def _snapshot_source(self, tier: CacheTier) -> Callable[..., Any]:
        async def source(drop_pending: Callable[[], None]) -> list[BlockHash]:
            with self._lock:  # our publishes happen under this lock: atomic with them
                drop_pending()
                return tier.hashes()
        return source

    # -- introspection -----------------------------------------------------------------
    def holdings(self) -> list[TierEntry]:
        """Every (hash, tier) this node holds (to rebuild the index after an outage)."""
        with self._lock:
            return [(h, t.name) for t in self.tiers for h in t.hashes()]

    def stats(self) -> TierStats:
        with self._lock:
            s = self._stats
            return TierStats(dict(s.hits), dict(s.bytes_loaded), dict(s.bytes_stored),
                             dict(s.evictions), {t.name: len(t) for t in self.tiers},
                             s.lookups, s.save_errors)

    def check_integrity(self) -> None:
        with self._lock:
            for t in self.tiers:
                t.check_integrity()

    def close(self, timeout: float = 10.0) -> None:
        """Finishes queued saves (bounded), stops the thread, closes every tier."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
        for t in self.tiers:
            try:
                t.close()
            except Exception as e:
                log.warning("closing tier %s failed: %s", t.name, e)

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
