"""Simulated offload tiers (host DRAM, local disk): the engine's `KVOffload` hook
(engine/offload.py) over kvtransfer's own LRU bookkeeping (kvtransfer/tiers/lru.py),
with no bytes. The engine's real OffloadConnector drives it from the real scheduler:
`lookup` when a request is admitted, `load` for the planned restores (their time goes
to the link model), `save` for newly cached device blocks.

TieredCache's policy (kvtransfer/tiers/manager.py): saves go to the first tier, its LRU
victims are demoted to the next, the last tier's victims are dropped; a read takes the
longest leading run across tiers. Saves complete at once here (the real copy runs off
the step loop and holds its device blocks briefly; the simulator does not hold them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from engine.block_hash import BlockHash
from kvtransfer.tiers.lru import LRUSlots

PublishFn = Callable[[list[tuple[BlockHash, str]], list[tuple[BlockHash, str]]], None]


class SimTiers:
    def __init__(self, capacities: Sequence[tuple[str, int]],
                 publish: PublishFn | None = None) -> None:
        self.tiers = [(name, LRUSlots(cap)) for name, cap in capacities if cap > 0]
        if not self.tiers:
            raise ValueError("SimTiers needs a tier with capacity > 0")
        self.publish = publish
        self.loaded: dict[str, int] = {}  # blocks restored per tier (cumulative)
        self.pending: list[tuple[str, int]] = []  # this step's restores, for the clock

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        return sum(n for _, _, n in self._plan(hashes))

    def _plan(self, hashes: Sequence[BlockHash]) -> list[tuple[str, LRUSlots, int]]:
        plan = []
        i = 0
        while i < len(hashes):
            for name, slots in self.tiers:
                n = slots.leading(hashes[i:])
                if n:
                    plan.append((name, slots, n))
                    i += n
                    break
            else:
                break
        return plan

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int],
             kv_cache: Any) -> int:
        got = 0
        for name, slots, n in self._plan(hashes):
            for h in hashes[got:got + n]:
                slots.touch(h)
            self.loaded[name] = self.loaded.get(name, 0) + n
            self.pending.append((name, n))
            got += n
        return got

    def save(self, hashes: Sequence[BlockHash], block_ids: Sequence[int],
             kv_cache: Any) -> list[int]:
        stored: list[tuple[BlockHash, str]] = []
        removed: list[tuple[BlockHash, str]] = []
        self._put(0, list(hashes), stored, removed)
        if self.publish is not None and (stored or removed):
            self.publish(stored, removed)
        return []

    def _put(self, level: int, hashes: list[BlockHash], stored: list[tuple[BlockHash, str]],
             removed: list[tuple[BlockHash, str]]) -> None:
        if level >= len(self.tiers) or not hashes:
            return
        name, slots = self.tiers[level]
        new = [h for h in hashes if h not in slots]
        for h in hashes:
            if h in slots:
                slots.touch(h)
        over = len(new) - slots.num_free
        demoted = slots.victims(over) if over > 0 else []
        for h in demoted:
            slots.remove(h)
            removed.append((h, name))
        for h in new[-slots.capacity:]:
            slots.insert(h)
            stored.append((h, name))
        self._put(level + 1, demoted, stored, removed)

    def take_saved(self, timeout: float = 0.0) -> list[int]:
        return []

    def take_pending(self) -> list[tuple[str, int]]:
        out, self.pending = self.pending, []
        return out

    def check_integrity(self) -> None:
        for _, slots in self.tiers:
            slots.check_integrity()
