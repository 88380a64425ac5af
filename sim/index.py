"""The in-process block index: kvtransfer.index.RedisBlockIndex's reader interface
(`lookup(hashes, nodes) -> IndexLookup`, `holders`) and its writer's effect (`apply`:
a node's stores and removals per tier), over dicts instead of Redis. The gateway's
real Locality (gateway/locality.py) reads it; simulated workers publish their block
pool's and tiers' events into it as the real KV event publisher does.

Epochs, TTLs and the circuit breaker have nothing to do in one process: every entry is
current, nothing fails.

Speed: at 512 workers the pools hold millions of blocks, a request stores and evicts
hundreds and a lookup walks hundreds, and a dict probe per block misses the CPU caches
(~200 ns each, what this index cost per block before). Hashes are ints laid out as
`segment << SEGMENT_SHIFT | block's number in the segment` (sim/workload.py: a segment
is one Mooncake hash id's tokens, 32 blocks of 16 tokens; a longer one is numbered in
parts of 32, each a segment here), so the device tier is kept
per segment: per node a bitmap of the segment's blocks it holds, and the bitmap of the
nodes holding all of them (sim/segments.py). An event applies a run of consecutive
blocks as one OR / AND per segment; a lookup walks segment by segment, one AND over the
nodes holding the whole segment, block bits only for the few holding part of it. Any
int is a valid hash: other layouts are exact too, one segment per block at worst.

The other tiers (host, disk) are rare and kept apart, per block: each node's bitmask of
those tiers and a bitmap of the nodes holding it there; a lookup that may meet them
walks block by block.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from itertools import compress
from typing import Final

from kvtransfer.index import TIERS, IndexLookup
from sim.segments import LOW, SEGMENT_SHIFT, Segment, runs_of, runs_of_lazily, set_bits

_BIT: Final = {t: 1 << i for i, t in enumerate(TIERS)}
_BEST: Final = [""] + [next(t for t in TIERS if m & _BIT[t]) for m in range(1, 1 << len(TIERS))]
_ONES: Final = bytes.maketrans(b"01", b"\x00\x01")  # a binary string -> 0/1 selectors
_KEEP_HOLDERS: Final = 64  # lookups keep the last 8 sets of at least 64 holders
_KEPT: Final = 8


class Deferred:
    """Removals of one node's device blocks that take effect at given simulated times:
    `hashes[i]` at `due[i]` (nondecreasing), `gone[i]` once applied; per segment, the
    positions of those not applied yet (a read of the segment applies the due ones
    first)."""

    __slots__ = ("node", "hashes", "due", "gone", "by_seg")

    def __init__(self, node: str, hashes: list[int], due: list[float]) -> None:
        self.node = node
        self.hashes = hashes
        self.due = due
        self.gone = bytearray(len(hashes))
        self.by_seg: dict[int, list[int]] = {}


class InProcessBlockIndex:
    """segment -> Segment (the device tier); the other tiers: block hash ->
    {node: bitmask of those tiers} and the bitmap of those nodes.

    Deferred removals (`defer`, a decode window's evictions at its iterations' starts,
    sim/window.py): every read applies those due by `clock()` in the segments it reads
    before it reads them, so it sees what removals published at their times would show;
    `settle` applies the rest of a batch at once (the window ends) or drops them (it was
    cut before their iterations)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock
        self._deferred: dict[int, list[Deferred]] = {}  # segment -> batches with some there
        self._segments: dict[int, Segment] = {}
        self._other: dict[int, dict[str, int]] = {}
        self._other_bits: dict[int, int] = {}
        self._bit: dict[str, int] = {}  # node -> 1 << its number
        self._names: list[str] = []  # number -> node
        self._device_runs: dict[int, tuple[str, ...]] = {}  # depth -> ("device",) * depth
        self._holders: dict[tuple[int, int], dict[str, tuple[str, ...]]] = {}
        self._allowed: tuple[frozenset[str] | None, int, int] = (None, 0, -1)
        self.errors = 0  # RedisBlockIndex's counter of failed calls (never here)
        self.lookups = 0

    def _node_bit(self, node: str) -> int:
        bit = self._bit.get(node)
        if bit is None:
            bit = self._bit[node] = 1 << len(self._names)
            self._names.append(node)
        return bit

    # -- writes -------------------------------------------------------------------------
    def apply_device(self, node: str, stored: Iterable[int] = (),
                     removed: Iterable[int] = ()) -> None:
        """`apply` for the device tier alone (the block pool's events): removals first."""
        removed = removed if isinstance(removed, (list, tuple)) else list(removed)
        stored = stored if isinstance(stored, (list, tuple)) else list(stored)
        self._apply_device_runs(node, runs_of(stored) if stored else [],
                                runs_of(removed, ordered=False) if removed else [])

    def _apply_device_runs(self, node: str, stored: list[tuple[int, int, int]],
                           removed: list[tuple[int, int, int]]) -> None:
        """`apply_device` of the blocks as `runs_of` gives them: (segment, first block,
        count), the removals sorted."""
        segments = self._segments
        bit = self._node_bit(node)
        if removed:
            for c, j, m in removed:
                s = segments.get(c)
                old = s.masks.get(bit, 0) if s is not None else 0
                new = old & ~(((1 << m) - 1) << j)
                if new == old:
                    continue
                assert s is not None
                if new:
                    s.masks[bit] = new
                else:
                    del s.masks[bit]
                    s.any ^= bit
                    if not s.masks:
                        del segments[c]
                        continue
                if s.full & bit:
                    s.full ^= bit
                    if not s.full:
                        s.refit()
        if stored:
            for c, j, m in stored:
                s = segments.get(c)
                if s is None:
                    s = segments[c] = Segment()
                old = s.masks.get(bit, 0)
                new = old | ((1 << m) - 1) << j
                if new == old:
                    continue
                s.masks[bit] = new
                s.any |= bit
                if j + m > s.length:  # no other node holds the new last block
                    s.length = j + m
                    s.full = bit if new == (1 << s.length) - 1 else 0
                elif new == (1 << s.length) - 1:
                    s.full |= bit

    def apply(self, node: str, stored: Sequence[tuple[int, str]] = (),
              removed: Sequence[tuple[int, str]] = ()) -> None:
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

    # -- deferred removals ---------------------------------------------------------------
    def defer(self, node: str, hashes: list[int], due: list[float]) -> Deferred:
        """Removes `hashes[i]` from `node`'s device tier at the time `due[i]`."""
        d = Deferred(node, hashes, due)
        for i, h in enumerate(hashes):
            c = h >> SEGMENT_SHIFT
            at = d.by_seg.get(c)
            if at is None:
                d.by_seg[c] = [i]
                self._deferred.setdefault(c, []).append(d)
            else:
                at.append(i)
        return d

    def settle(self, d: Deferred, until: float) -> None:
        """The batch's removals due by `until` take effect now (those not yet); the
        others never do."""
        keep = bisect_right(d.due, until)
        gone = [h for h, g in zip(d.hashes[:keep], d.gone[:keep], strict=True) if not g]
        d.hashes, d.due = [], []
        deferred = self._deferred
        for c in d.by_seg:
            batches = deferred[c]
            batches.remove(d)
            if not batches:
                del deferred[c]
        d.by_seg.clear()
        if gone:
            self.apply_device(d.node, (), gone)

    def _due(self, c: int) -> None:
        """Applies the deferred removals in segment `c` due by now."""
        assert self.clock is not None
        now = self.clock()
        batches = self._deferred[c]
        for d in list(batches):
            at = d.by_seg[c]
            due = d.due
            n = bisect_right(at, now, key=due.__getitem__)
            if not n:
                continue
            for i in at[:n]:
                d.gone[i] = 1
            if n < len(at):
                d.by_seg[c] = at[n:]
            else:
                del d.by_seg[c]
                batches.remove(d)
                if not batches:
                    del self._deferred[c]
            self.apply_device(d.node, (), [d.hashes[i] for i in at[:n]])

    def _all_due(self) -> None:
        """Applies every deferred removal due by now (a read of the whole index)."""
        for c in list(self._deferred):
            if c in self._deferred:
                self._due(c)

    # -- reads --------------------------------------------------------------------------
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

    def _device_holders(self, bits: int, depth: int) -> dict[str, tuple[str, ...]]:
        """node -> its run of `depth` device blocks, for the nodes of `bits`. The large
        ones are kept for the next lookups and shared with them (most prompts of a trace
        start with one shared prefix that most nodes hold: the same nodes, run after
        run): the caller copies one before it changes it."""
        key = (bits, depth)
        got = self._holders.get(key)
        if got is None:
            got = dict.fromkeys(self._nodes_of(bits), self._device_run(depth))
            if len(got) < _KEEP_HOLDERS:
                return got
            if len(self._holders) >= _KEPT:
                del self._holders[next(iter(self._holders))]  # the oldest
            self._holders[key] = got
        return got

    def _device_bits(self, h: int) -> int:
        """The bitmap of the nodes holding `h` on the device."""
        c = h >> SEGMENT_SHIFT
        if c in self._deferred:
            self._due(c)
        s = self._segments.get(c)
        if s is None:
            return 0
        j = h & LOW
        bits = s.full if j < s.length else 0
        for b in set_bits(s.any & ~s.full):
            if s.masks[b] >> j & 1:
                bits |= b
        return bits

    def _best(self, h: int, node: str) -> str:
        """The best tier `node` holds `h` in."""
        if self._device_bits(h) & self._bit[node]:
            return "device"
        return _BEST[self._other[h][node]]

    def _walk_segments(self, hashes: Sequence[int], allowed: int
                       ) -> tuple[int, dict[int, int]]:
        """The device-only walk: (blocks some allowed node holds from the start, depth ->
        the nodes whose run ends there)."""
        segments, deferred = self._segments, self._deferred
        ends: dict[int, int] = {}
        alive = 0  # nodes holding every block so far
        depth = 0
        for c, j, m in runs_of_lazily(hashes):
            if c in deferred:
                self._due(c)
            s = segments.get(c)
            if s is None:
                break
            if depth:
                pool = alive & s.any
                if gone := alive & ~pool:
                    ends[depth] = ends.get(depth, 0) | gone
            else:
                pool = s.any & allowed
            keep = pool & s.full if j + m <= s.length else 0
            whole = (1 << m) - 1
            for b in set_bits(pool & ~keep):
                x = s.masks[b] >> j & whole
                if x == whole:
                    keep |= b
                elif x & 1 or depth:
                    end = depth + (x ^ (x + 1)).bit_length() - 1  # + its trailing ones
                    ends[end] = ends.get(end, 0) | b
            alive = keep
            if not alive:  # every run ended: the walk goes on while some node holds
                x = s.held(allowed) >> j & whole
                if x != whole:
                    return depth + (x ^ (x + 1)).bit_length() - 1, ends
                depth += m
                break
            depth += m
        else:
            if alive:
                ends[depth] = alive
            return depth, ends
        if alive:  # the walk stopped at a segment nobody holds
            ends[depth] = ends.get(depth, 0) | alive
            return depth, ends
        return self._walk_on(hashes, depth, allowed), ends

    def _walk_on(self, hashes: Sequence[int], depth: int, allowed: int) -> int:
        """From `depth` on, the blocks some allowed node holds, one after the other."""
        for c, j, m in runs_of_lazily(hashes[depth:]):
            if c in self._deferred:
                self._due(c)
            s = self._segments.get(c)
            if s is None:
                break
            whole = (1 << m) - 1
            x = s.held(allowed) >> j & whole
            if x != whole:
                return depth + (x ^ (x + 1)).bit_length() - 1
            depth += m
        return depth

    def _walk_blocks(self, hashes: Sequence[int], allowed: int
                     ) -> tuple[int, dict[int, int], int]:
        """The walk through every tier, block by block: (blocks walked, depth -> nodes
        whose run ends there, the nodes whose run holds a block in another tier only)."""
        other_bits = self._other_bits
        alive = 0
        ends: dict[int, int] = {}
        tiered = 0
        i = 0
        for h in hashes:
            d = self._device_bits(h)
            o = other_bits.get(h, 0)
            bits = (d | o) & allowed
            if not bits:
                break
            if i == 0:
                alive = bits
            else:
                kept = alive & bits
                if kept != alive:
                    ends[i] = alive ^ kept
                    alive = kept
            if o:
                tiered |= o & ~d & alive
            i += 1
        if alive:
            ends[i] = alive
        return i, ends, tiered

    def lookup_now(self, hashes: Sequence[int],
                   nodes: set[str] | frozenset[str] | None = None) -> IndexLookup:
        """The leading run any (allowed) node holds, and each node's own run with the
        best tier per block (RedisBlockIndex._walk's result)."""
        self.lookups += 1
        allowed = self._allowed_bits(nodes) & ((1 << len(self._names)) - 1)
        if self._other_bits:
            i, ends, tiered = self._walk_blocks(hashes, allowed)
        else:
            (i, ends), tiered = self._walk_segments(hashes, allowed), 0
        # (a lookup's mapping is read, never changed: it may be a kept one, shared)
        runs: dict[str, tuple[str, ...]] = {}
        own = False  # `runs` is this lookup's own dict (not a kept one)
        for depth in sorted(ends):
            bits = ends[depth]
            device = self._device_holders(bits & ~tiered, depth)
            if not runs:
                runs = device
            else:
                if not own:
                    runs, own = runs.copy(), True
                runs.update(device)
            if bits & tiered:
                if not own:
                    runs, own = runs.copy(), True
                for node in self._nodes_of(bits & tiered):
                    runs[node] = tuple(self._best(h, node) for h in hashes[:depth])
        return IndexLookup(i, runs)

    async def lookup(self, hashes: Sequence[int],
                     nodes: set[str] | frozenset[str] | None = None) -> IndexLookup | None:
        return self.lookup_now(hashes, nodes)

    async def holders(self, hashes: Sequence[int]
                      ) -> dict[int, frozenset[str]] | None:
        return {h: frozenset(self._nodes_of(self._device_bits(h)))
                | frozenset(self._other.get(h, ())) for h in hashes}

    def num_entries(self) -> int:
        """(block, node) pairs held in some tier."""
        self._all_due()
        n = sum(m.bit_count() for s in self._segments.values() for m in s.masks.values())
        for h, holders in self._other.items():
            d = self._device_bits(h)
            n += sum(not d & self._bit[node] for node in holders)
        return n

    async def close(self) -> None:
        return None
