"""The in-process block index: kvtransfer.index.RedisBlockIndex's reader interface
(`lookup(hashes, nodes) -> IndexLookup`, `holders`) and its writer's effect (`apply`:
a node's stores and removals per tier), over dicts instead of Redis. The gateway's
real Locality (gateway/locality.py) reads it; simulated workers publish their block
pool's and tiers' events into it as the real KV event publisher does.

Epochs, TTLs and the circuit breaker have nothing to do in one process: every entry is
current, nothing fails.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_hash import BlockHash
from kvtransfer.index import TIERS, IndexLookup

_BIT = {t: 1 << i for i, t in enumerate(TIERS)}
_BEST = [""] + [next(t for t in TIERS if m & _BIT[t]) for m in range(1, 1 << len(TIERS))]


class InProcessBlockIndex:
    """block hash -> {node: bitmask of the tiers holding it}."""

    def __init__(self) -> None:
        self._blocks: dict[BlockHash, dict[str, int]] = {}
        self.errors = 0  # RedisBlockIndex's counter of failed calls (never here)
        self.lookups = 0

    def apply(self, node: str, stored: Sequence[tuple[BlockHash, str]] = (),
              removed: Sequence[tuple[BlockHash, str]] = ()) -> None:
        """Removals first, then stores (a batch evicts before it reuses)."""
        blocks = self._blocks
        for h, tier in removed:
            holders = blocks.get(h)
            if holders is None:
                continue
            m = holders.get(node, 0) & ~_BIT[tier]
            if m:
                holders[node] = m
            else:
                holders.pop(node, None)
                if not holders:
                    del blocks[h]
        for h, tier in stored:
            holders = blocks.setdefault(h, {})
            holders[node] = holders.get(node, 0) | _BIT[tier]

    def lookup_now(self, hashes: Sequence[BlockHash],
                   nodes: set[str] | frozenset[str] | None = None) -> IndexLookup:
        """The leading run any (allowed) node holds, and each node's own run with the
        best tier per block (RedisBlockIndex._walk's result)."""
        self.lookups += 1
        runs: dict[str, list[str]] = {}
        blocks = self._blocks
        i = 0
        for h in hashes:
            holders = blocks.get(h)
            if not holders:
                break
            any_node = False
            for node, mask in holders.items():
                if nodes is not None and node not in nodes:
                    continue
                any_node = True
                run = runs.get(node)
                if run is None:
                    if i == 0:
                        runs[node] = [_BEST[mask]]
                elif len(run) == i:
                    run.append(_BEST[mask])
            if not any_node:
                break
            i += 1
        return IndexLookup(i, {n: tuple(r) for n, r in runs.items()})

    async def lookup(self, hashes: Sequence[BlockHash],
                     nodes: set[str] | frozenset[str] | None = None) -> IndexLookup | None:
        return self.lookup_now(hashes, nodes)

    async def holders(self, hashes: Sequence[BlockHash]
                      ) -> dict[BlockHash, frozenset[str]] | None:
        return {h: frozenset(self._blocks.get(h, {})) for h in hashes}

    def num_entries(self) -> int:
        return sum(len(v) for v in self._blocks.values())

    async def close(self) -> None:
        return None
