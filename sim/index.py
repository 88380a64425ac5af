"""The in-process block index: kvtransfer.index.RedisBlockIndex's reader interface
(`lookup(hashes, nodes) -> IndexLookup`, `holders`) and its writer's effect (`apply`:
a node's stores and removals per tier), over dicts instead of Redis. The gateway's
real Locality (gateway/locality.py) reads it; simulated workers publish their block
pool's and tiers' events into it as the real KV event publisher does.

Epochs, TTLs and the circuit breaker have nothing to do in one process: every entry is
current, nothing fails.

Speed: at 512 workers a shared system prompt is held by every worker, so a walk that
visits each (block, holder) pair costs O(workers x blocks) per request. Each block also
keeps a bitmap of its holders (bit = the node's number), so the walk is one AND per
block over the nodes whose run is still unbroken; a node leaves that set once, and its
run is a cached ("device",) * depth unless one of its blocks is held in another tier
only (a second bitmap per block says which), which is rare and walked per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress

from engine.block_hash import BlockHash
from kvtransfer.index import TIERS, IndexLookup

_BIT = {t: 1 << i for i, t in enumerate(TIERS)}
_BEST = [""] + [next(t for t in TIERS if m & _BIT[t]) for m in range(1, 1 << len(TIERS))]
_DEVICE = _BIT["device"]
_ONES = bytes.maketrans(b"01", b"\x00\x01")  # a binary string -> 0/1 selectors


class InProcessBlockIndex:
    """block hash -> {node: bitmask of the tiers holding it}, plus the bitmaps above."""

    def __init__(self) -> None:
        self._blocks: dict[BlockHash, dict[str, int]] = {}
        self._held: dict[BlockHash, int] = {}  # hash -> bitmap of its holders
        self._elsewhere: dict[BlockHash, int] = {}  # hash -> holders without it on device
        self._bit: dict[str, int] = {}  # node -> 1 << its number
        self._names: list[str] = []  # number -> node
        self._device_runs: dict[int, tuple[str, ...]] = {}  # depth -> ("device",) * depth
        self._allowed: tuple[frozenset[str] | None, int, int] = (None, 0, -1)
        self.errors = 0  # RedisBlockIndex's counter of failed calls (never here)
        self.lookups = 0

    def _node_bit(self, node: str) -> int:
        bit = self._bit.get(node)
        if bit is None:
            bit = self._bit[node] = 1 << len(self._names)
            self._names.append(node)
        return bit

    def apply(self, node: str, stored: Sequence[tuple[BlockHash, str]] = (),
              removed: Sequence[tuple[BlockHash, str]] = ()) -> None:
        """Removals first, then stores (a batch evicts before it reuses)."""
        blocks, held, elsewhere = self._blocks, self._held, self._elsewhere
        bit = self._node_bit(node)
        for h, tier in removed:
            holders = blocks.get(h)
            if holders is None:
                continue
            m = holders.get(node, 0) & ~_BIT[tier]
            if m:
                holders[node] = m
                if not m & _DEVICE:
                    elsewhere[h] = elsewhere.get(h, 0) | bit
                continue
            holders.pop(node, None)
            if not holders:
                del blocks[h], held[h]
                elsewhere.pop(h, None)
                continue
            held[h] &= ~bit
            e = elsewhere.get(h, 0) & ~bit
            if e:
                elsewhere[h] = e
            else:
                elsewhere.pop(h, None)
        for h, tier in stored:
            t = _BIT[tier]
            holders = blocks.get(h)
            if holders is None:  # most stores: a new prefix, or output blocks
                blocks[h] = {node: t}
                held[h] = bit
                if t != _DEVICE:
                    elsewhere[h] = bit
                continue
            m = holders[node] = holders.get(node, 0) | t
            held[h] |= bit
            if not m & _DEVICE:
                elsewhere[h] = elsewhere.get(h, 0) | bit
            elif h in elsewhere:
                e = elsewhere[h] & ~bit
                if e:
                    elsewhere[h] = e
                else:
                    del elsewhere[h]

    def _allowed_bits(self, nodes: set[str] | frozenset[str] | None) -> int:
        """The bitmap of `nodes` (-1: any); a frozenset's is kept for the next call."""
        if nodes is None:
            return -1
        cached, n, bits = self._allowed
        if nodes is cached and n == len(self._names):
            return bits
        bits = 0
        for node in nodes:
            bits |= self._bit.get(node, 0)
        if isinstance(nodes, frozenset):
            self._allowed = (nodes, len(self._names), bits)
        return bits

    def _nodes_of(self, bits: int) -> list[str]:
        return list(compress(self._names, bin(bits)[:1:-1].encode().translate(_ONES)))

    def _device_run(self, depth: int) -> tuple[str, ...]:
        run = self._device_runs.get(depth)
        if run is None:
            run = self._device_runs[depth] = ("device",) * depth
        return run

    def lookup_now(self, hashes: Sequence[BlockHash],
                   nodes: set[str] | frozenset[str] | None = None) -> IndexLookup:
        """The leading run any (allowed) node holds, and each node's own run with the
        best tier per block (RedisBlockIndex._walk's result)."""
        self.lookups += 1
        allowed = self._allowed_bits(nodes)
        held, elsewhere = self._held, self._elsewhere
        alive = 0  # nodes holding every block so far
        ends: list[tuple[int, int]] = []  # (nodes whose run ended, its length)
        tiered = 0  # nodes whose run holds a block in another tier than the device
        i = 0
        for h in hashes:
            bits = held.get(h, 0) & allowed
            if not bits:
                break
            if i == 0:
                alive = bits
            elif alive & ~bits:
                ends.append((alive & ~bits, i))
                alive &= bits
            if alive and h in elsewhere:
                tiered |= elsewhere[h] & alive
            i += 1
        if alive:
            ends.append((alive, i))
        runs: dict[str, tuple[str, ...]] = {}
        for bits, depth in ends:
            runs.update(dict.fromkeys(self._nodes_of(bits & ~tiered), self._device_run(depth)))
            if bits & tiered:
                for node in self._nodes_of(bits & tiered):
                    runs[node] = tuple(_BEST[self._blocks[h][node]] for h in hashes[:depth])
        return IndexLookup(i, runs)

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
