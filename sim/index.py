"""The in-process block index: kvtransfer.index.RedisBlockIndex's reader interface
(`lookup(hashes, nodes) -> IndexLookup`, `holders`) and its writer's effect (`apply`:
a node's stores and removals per tier), over dicts instead of Redis. The gateway's
real Locality (gateway/locality.py) reads it; simulated workers publish their block
pool's and tiers' events into it as the real KV event publisher does.

Epochs, TTLs and the circuit breaker have nothing to do in one process: every entry is
current, nothing fails.

Speed: at 512 workers a shared system prompt is held by every worker, so a walk that
visits each (block, holder) pair costs O(workers x blocks) per request. Each block
keeps a bitmap of the nodes holding it on the device (bit = the node's number), so the
walk is one AND per block over the nodes whose run is still unbroken; a node leaves
that set once, and its run is a cached ("device",) * depth. The other tiers (host,
disk) are rare and kept apart: per block, each node's bitmask of those tiers and a
bitmap of the nodes holding it there; a run through a block a node holds in another
tier only is walked per block. A device store or removal, the bulk of the events (every
block a prompt fills, every eviction), is one dict lookup and one OR / AND.

What is left is memory, not the interpreter: at 512 workers the device dict holds
millions of blocks and each probe misses the CPU caches (~200 ns per hash, stores and
walk alike). C-level variants (map + dict.fromkeys + update for stores; accumulate of the
ANDs with runs cached per (nodes, depth) for the walk) measured no faster in the
simulator (issue 17), so the loops stay.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import compress

from engine.block_hash import BlockHash
from kvtransfer.index import TIERS, IndexLookup

_BIT = {t: 1 << i for i, t in enumerate(TIERS)}
_BEST = [""] + [next(t for t in TIERS if m & _BIT[t]) for m in range(1, 1 << len(TIERS))]
_DEVICE = _BIT["device"]
_ONES = bytes.maketrans(b"01", b"\x00\x01")  # a binary string -> 0/1 selectors


class InProcessBlockIndex:
    """block hash -> bitmap of the nodes holding it on the device; the other tiers:
    block hash -> {node: bitmask of those tiers} and the bitmap of those nodes."""

    def __init__(self) -> None:
        self._device: dict[BlockHash, int] = {}
        self._other: dict[BlockHash, dict[str, int]] = {}
        self._other_bits: dict[BlockHash, int] = {}
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

    def apply_device(self, node: str, stored: Iterable[BlockHash] = (),
                     removed: Iterable[BlockHash] = ()) -> None:
        """`apply` for the device tier alone (the block pool's events): removals first."""
        device = self._device
        get = device.get
        bit = self._node_bit(node)
        for h in removed:
            m = get(h)
            if m is None:
                continue
            if m == bit:  # most blocks: this node was the only holder
                del device[h]
            elif m & bit:
                device[h] = m ^ bit
        for h in stored:
            m = get(h)
            device[h] = bit if m is None else m | bit

    def apply(self, node: str, stored: Sequence[tuple[BlockHash, str]] = (),
              removed: Sequence[tuple[BlockHash, str]] = ()) -> None:
        """Removals first, then stores (a batch evicts before it reuses)."""
        self.apply_device(node, [h for h, t in stored if t == "device"],
                          [h for h, t in removed if t == "device"])
        other, other_bits = self._other, self._other_bits
        bit = self._node_bit(node)
        for h, tier in removed:
            holders = other.get(h) if tier != "device" else None
            if holders is None or node not in holders:
                continue
            m = holders[node] & ~_BIT[tier]
            if m:
                holders[node] = m
                continue
            del holders[node]
            if holders:
                other_bits[h] &= ~bit
            else:
                del other[h], other_bits[h]
        for h, tier in stored:
            if tier != "device":
                holders = other.setdefault(h, {})
                holders[node] = holders.get(node, 0) | _BIT[tier]
                other_bits[h] = other_bits.get(h, 0) | bit

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

    def _best(self, h: BlockHash, node: str) -> str:
        """The best tier `node` holds `h` in."""
        if self._device.get(h, 0) & self._bit[node]:
            return "device"
        return _BEST[self._other[h][node]]

    def lookup_now(self, hashes: Sequence[BlockHash],
                   nodes: set[str] | frozenset[str] | None = None) -> IndexLookup:
        """The leading run any (allowed) node holds, and each node's own run with the
        best tier per block (RedisBlockIndex._walk's result)."""
        self.lookups += 1
        allowed = self._allowed_bits(nodes)
        everyone = (1 << len(self._names)) - 1
        masked = allowed & everyone != everyone  # some node is left out
        device, other_bits = self._device, self._other_bits
        get = device.get
        alive = 0  # nodes holding every block so far
        ends: list[tuple[int, int]] = []  # (nodes whose run ended, its length)
        tiered = 0  # nodes whose run holds a block in another tier only
        i = 0
        for h in hashes:
            d = get(h, 0)
            o = other_bits.get(h, 0) if other_bits else 0
            bits = d | o if o else d
            if masked:
                bits &= allowed
            if not bits:
                break
            if i == 0:
                alive = bits
            else:
                kept = alive & bits
                if kept != alive:
                    ends.append((alive ^ kept, i))
                    alive = kept
            if o:
                tiered |= o & ~d & alive
            i += 1
        if alive:
            ends.append((alive, i))
        runs: dict[str, tuple[str, ...]] = {}
        for bits, depth in ends:
            runs.update(dict.fromkeys(self._nodes_of(bits & ~tiered), self._device_run(depth)))
            if bits & tiered:
                for node in self._nodes_of(bits & tiered):
                    runs[node] = tuple(self._best(h, node) for h in hashes[:depth])
        return IndexLookup(i, runs)

    async def lookup(self, hashes: Sequence[BlockHash],
                     nodes: set[str] | frozenset[str] | None = None) -> IndexLookup | None:
        return self.lookup_now(hashes, nodes)

    async def holders(self, hashes: Sequence[BlockHash]
                      ) -> dict[BlockHash, frozenset[str]] | None:
        return {h: frozenset(self._nodes_of(self._device.get(h, 0)))
                | frozenset(self._other.get(h, ())) for h in hashes}

    def num_entries(self) -> int:
        """(block, node) pairs held in some tier."""
        return sum((self._device.get(h, 0) | self._other_bits.get(h, 0)).bit_count()
                   for h in self._device.keys() | self._other_bits.keys())

    async def close(self) -> None:
        return None
