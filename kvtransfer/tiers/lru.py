"""LRU bookkeeping shared by the slot-based tiers: hash -> slot, least recent first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import islice

from engine.block_hash import BlockHash
from kvtransfer.tiers.base import SpareFn


class LRUSlots:
    """`capacity` slots; each held block occupies one. Pure bookkeeping, no data."""

    def __init__(self, capacity: int, spare_scan: int = 64) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.spare_scan = spare_scan
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, h: object) -> bool:
        return h in self._slots

    def __iter__(self) -> Iterator[BlockHash]:
        return iter(self._slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot(self, h: BlockHash) -> int | None:
        return self._slots.get(h)

    def leading(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self._slots:
                break
            n += 1
        return n

    def touch(self, h: BlockHash) -> None:
        self._slots.move_to_end(h)

    def victims(self, n: int, spare: SpareFn | None = None,
                exclude: frozenset[BlockHash] = frozenset()) -> list[BlockHash]:
        """The `n` least recently used blocks, skipping spared ones among the first
        `spare_scan` candidates while unspared ones remain (then LRU regardless)."""
        out: list[BlockHash] = []
        kept: list[BlockHash] = []
        for h in islice(self._slots, n + self.spare_scan + len(exclude)):
            if len(out) == n:
                break
            if h in exclude:
                continue
            if spare is not None and spare(h):
                kept.append(h)
            else:
                out.append(h)
        if len(out) < n:  # not enough unspared candidates: spared ones go, oldest first
            out += kept[:n - len(out)]
        if len(out) < n:
            rest = (h for h in self._slots if h not in exclude and h not in out)
            out += list(islice(rest, n - len(out)))
        return out

    def insert(self, h: BlockHash) -> int:
        """Takes a free slot for `h` (most recently used). Raises if none is free."""
        if h in self._slots:
            raise KeyError("block already held")
        if not self._free:
            raise RuntimeError("no free slot: evict first")
        slot = self._free.pop()
        self._slots[h] = slot
        return slot

    def remove(self, h: BlockHash) -> int | None:
        slot = self._slots.pop(h, None)
        if slot is not None:
            self._free.append(slot)
        return slot

    def check_integrity(self) -> None:
        used = list(self._slots.values())
        assert len(set(used)) == len(used), "slot held twice"
        assert not set(used) & set(self._free), "slot both free and held"
        assert len(used) + len(self._free) == self.capacity, "slots leaked"
