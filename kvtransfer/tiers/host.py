"""Host DRAM tier: one preallocated (pinned where CUDA is available) tensor of
`capacity` blocks, LRU. Ownership: the tier owns the buffer; `get` copies out."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.block_hash import BlockHash
from kvtransfer.layout import KVLayout
from kvtransfer.memory import torch_dtype
from kvtransfer.tiers.base import SpareFn
from kvtransfer.tiers.lru import LRUSlots


class HostTier:
    name = "host"

    def __init__(self, layout: KVLayout, capacity: int, pin_memory: bool | None = None,
                 spare_scan: int = 64) -> None:
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.layout = layout
        self.capacity = capacity
        self.pinned = pin_memory
        self._lru = LRUSlots(capacity, spare_scan)
        self.buffer = torch.empty(layout.tensor_shape(capacity), dtype=torch_dtype(layout),
                                  pin_memory=pin_memory)

    def __len__(self) -> int:
        return len(self._lru)

    def contains(self, hashes: Sequence[BlockHash]) -> int:
        return self._lru.leading(hashes)

    def get(self, hashes: Sequence[BlockHash], dst: Sequence[torch.Tensor]) -> int:
        n = self._lru.leading(hashes)
        for h, d in zip(hashes[:n], dst, strict=False):
            slot = self._lru.slot(h)
            assert slot is not None
            d.copy_(self.buffer[slot], non_blocking=d.is_cuda)
            self._lru.touch(h)
        return min(n, len(dst))

    def view(self, h: BlockHash) -> torch.Tensor | None:
        """The held block itself (no copy; valid until it is evicted)."""
        slot = self._lru.slot(h)
        return None if slot is None else self.buffer[slot]

    def put(self, hashes: Sequence[BlockHash], src: Sequence[torch.Tensor],
            spare: SpareFn | None = None) -> list[BlockHash]:
        evicted: list[BlockHash] = []
        for h, s in zip(hashes, src, strict=True):
            if h in self._lru:
                self._lru.touch(h)
                continue
            if not self._lru.num_free:
                victim = self._lru.victims(1, spare)[0]
                self._lru.remove(victim)
                evicted.append(victim)
            self.buffer[self._lru.insert(h)].copy_(s)
        return evicted

    def victims(self, n: int, spare: SpareFn | None = None) -> list[BlockHash]:
        return self._lru.victims(n, spare)

    def evict(self, hashes: Sequence[BlockHash]) -> int:
        return sum(self._lru.remove(h) is not None for h in hashes)

    def hashes(self) -> list[BlockHash]:
        return list(self._lru)

    @property
    def num_free(self) -> int:
        return self._lru.num_free

    def check_integrity(self) -> None:
        self._lru.check_integrity()

    def close(self) -> None:
        pass
