"""Sole-copy sparing from the Redis block index: the `spare` predicate TieredCache's
eviction calls ("is this block the cluster's only copy?"), answered from a cached view.

Eviction runs on the offload thread and must never wait for Redis, so the predicate only
reads a set. A background task on the index's event loop refreshes it every
`interval_s`: it takes this node's eviction candidates (the `per_tier` least recently
used blocks of each tier, the only ones eviction looks at), asks the index in batches
which nodes hold them, and keeps the hashes no other node holds. A block it has not
checked, or a view older than `max_age_s` (Redis down, refresh failing), is not spared:
eviction falls back to plain LRU, it never stalls.

Ownership: a SoleCopyView owns its refresh task (`start` / `close`); it borrows the index
(the worker's index publisher owns it) and the TieredCache it reads holdings from.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.block_hash import BlockHash
from kvtransfer.tiers.base import BlockHolders

if TYPE_CHECKING:
    from kvtransfer.tiers.manager import TieredCache

log = logging.getLogger(__name__)

Holdings = Callable[[], Sequence[tuple[BlockHash, str]]]  # (hash, tier), LRU first per tier


@dataclass(frozen=True, slots=True)
class SparingConfig:
    interval_s: float = 1.0  # refresh period
    max_age_s: float = 5.0  # a view not refreshed for this long spares nothing
    per_tier: int = 256  # least recently used blocks per tier checked (eviction's candidates)
    batch_size: int = 256  # blocks per index call

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.max_age_s <= 0:
            raise ValueError("interval_s and max_age_s must be positive")
        if self.per_tier < 1 or self.batch_size < 1:
            raise ValueError("per_tier and batch_size must be >= 1")


def eviction_candidates(holdings: Sequence[tuple[BlockHash, str]], per_tier: int
                        ) -> list[BlockHash]:
    """The first `per_tier` blocks of each tier in `holdings` (LRU order per tier)."""
    seen: dict[str, int] = {}
    out: list[BlockHash] = []
    for h, tier in holdings:
        if seen.get(tier, 0) < per_tier:
            seen[tier] = seen.get(tier, 0) + 1
            out.append(h)
    return out


class SoleCopyView:
    """Callable as a `SpareFn`: True for a block the last fresh refresh found on no
    other node. Any thread may call it; `refresh` runs on the index's event loop."""

    def __init__(self, index: BlockHolders, node: str, holdings: Holdings,
                 config: SparingConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not node:
            raise ValueError("node must be non-empty")
        self.index = index
        self.node = node
        self.holdings = holdings
        self.config = config or SparingConfig()
        self._clock = clock
        # (sole hashes, when they were read): replaced whole, so readers need no lock
        self._view: tuple[frozenset[BlockHash], float] = (frozenset(), float("-inf"))
        self._task: asyncio.Task[None] | None = None
        self.refreshes = self.failures = 0

    def __call__(self, h: BlockHash) -> bool:
        sole, at = self._view
        return h in sole and self._clock() - at <= self.config.max_age_s

    def __len__(self) -> int:
        """Blocks spared now (0 when the view is stale)."""
        sole, at = self._view
        return len(sole) if self._clock() - at <= self.config.max_age_s else 0

    async def refresh(self) -> bool:
        """Re-reads the holders of this node's eviction candidates. False (view kept until
        it ages out) when the index could not answer for every batch."""
        started = self._clock()
        holdings = await asyncio.to_thread(self.holdings)  # takes the cache's lock
        candidates = eviction_candidates(holdings, self.config.per_tier)
        sole: set[BlockHash] = set()
        step = self.config.batch_size
        for i in range(0, len(candidates), step):
            holders = await self.index.holders(candidates[i:i + step])
            if holders is None:
                self.failures += 1
                return False
            sole.update(h for h, nodes in holders.items() if not nodes - {self.node})
        self._view = (frozenset(sole), started)
        self.refreshes += 1
        return True

    def start(self) -> None:
        """Refreshes every interval_s on the running loop until `close`."""
        self._task = asyncio.create_task(self._run(), name=f"sole-copy-view-{self.node}")

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # advisory: a bug here must not kill the worker
                self.failures += 1
                log.exception("sole-copy view refresh failed")
            await asyncio.sleep(self.config.interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


def start_sole_copy_sparing(tiers: TieredCache, index: BlockHolders, node: str,
                            config: SparingConfig | None = None) -> SoleCopyView:
    """Makes `tiers`' eviction spare blocks no other node holds (per `index`), refreshed
    on the running loop. The caller `close()`s the view before closing the index."""
    view = SoleCopyView(index, node, tiers.holdings, config)
    tiers.spare = view
    view.start()
    return view
