"""The in-process index's device tier, segment by segment (sim/index.py): a block
hash is `segment << SEGMENT_SHIFT | block's number in the segment` (sim/workload.py), a
segment's holders are bitmaps (`Segment`), and a batch of hashes is walked as runs of
consecutive blocks of one segment (`runs_of`, `runs_of_lazily`), one OR / AND per run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

# A hash (an int: sim/workload.py's) = segment << this | block number. Small, so that
# the segment is in a hash's low bits: CPython's dicts (the block pools' prefix maps)
# start probing at hash & (size - 1), and with 21 bits of block number every key of a
# map started in the same 32 slots (3-4 probes, each a cache miss, per lookup).
SEGMENT_SHIFT = 5
LOW = (1 << SEGMENT_SHIFT) - 1
# Events of at least this many hashes that start with a run (their first this many
# one apart: a long prompt's blocks, or its blocks freed tail first) go to runs through
# numpy; scattered ones (e.g. one block per segment at 512-token blocks) stay in Python,
# ~4x faster there.
_NUMPY_FROM = 16


def set_bits(x: int) -> Iterator[int]:
    """The set bits of `x`, lowest first, each as an int with that bit alone."""
    while x:
        low = x & -x
        yield low
        x ^= low


class Segment:
    """The nodes holding blocks of one segment on the device. `full` holds the nodes
    holding its blocks [0, length); every node holds blocks below `length` only."""

    __slots__ = ("any", "full", "length", "masks")

    def __init__(self) -> None:
        self.any = 0  # nodes holding some of its blocks
        self.full = 0
        self.length = 0
        self.masks: dict[int, int] = {}  # node bit -> its blocks' bitmap

    def refit(self) -> None:
        """`length` down to the blocks held, `full` again (after the last full node
        lost a block: keeps a segment's lone holder on the walk's fast path)."""
        length = max(map(int.bit_length, self.masks.values()))
        whole = (1 << length) - 1
        self.length = length
        self.full = sum(b for b, m in self.masks.items() if m == whole)

    def held(self, allowed: int) -> int:
        """The bitmap of the blocks some node of `allowed` holds."""
        if self.full & allowed:
            return (1 << self.length) - 1
        out = 0
        for b, m in self.masks.items():
            if b & allowed:
                out |= m
        return out


def runs_of(hashes: Sequence[int], ordered: bool = True) -> list[tuple[int, int, int]]:
    """`hashes` as runs of consecutive blocks of one segment: (segment, first block,
    count), in order, or (not `ordered`: a set of blocks, e.g. evictions, which come
    tail first) sorted, a repeat as a run of its own."""
    n = len(hashes)
    if n >= _NUMPY_FROM and abs(hashes[_NUMPY_FROM - 1] - hashes[0]) == _NUMPY_FROM - 1:
        return _runs_numpy(hashes, ordered)
    if not ordered:
        hashes = sorted(hashes)
    out: list[tuple[int, int, int]] = []
    prev = None
    for h in hashes:
        if prev is not None and h == prev + 1 and h & LOW:
            c, j, m = out[-1]
            out[-1] = (c, j, m + 1)
        else:
            out.append((h >> SEGMENT_SHIFT, h & LOW, 1))
        prev = h
    return out


def _runs_numpy(hashes: Sequence[int], ordered: bool) -> list[tuple[int, int, int]]:
    """`runs_of` at C speed per block (a fixed ~6 us: worth it for long runs)."""
    n = len(hashes)
    a = np.fromiter(hashes, np.int64, n)
    if not ordered:
        a.sort()
    first = np.empty(n, np.bool_)  # where a run starts: not one past the last, or block 0
    first[0] = True
    b = a[1:]
    np.not_equal(b, a[:-1] + 1, out=first[1:])
    first[1:] |= (b & LOW) == 0
    at = first.nonzero()[0]
    starts = a[at]
    counts = np.empty(len(at), np.int64)
    counts[:-1] = at[1:] - at[:-1]
    counts[-1] = n - at[-1]
    return list(zip((starts >> SEGMENT_SHIFT).tolist(), (starts & LOW).tolist(),
                    counts.tolist(), strict=True))


def runs_of_lazily(hashes: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """`runs_of(hashes)` one run at a time, for a walk that may stop after a few: a run
    as long as its segment allows is checked against its range in one comparison."""
    i, n = 0, len(hashes)
    while i < n:
        h = hashes[i]
        j = h & LOW
        m = min(LOW + 1 - j, n - i)  # the longest run here: to its segment's end
        if m > 1 and (hashes[i + m - 1] != h + m - 1
                      or hashes[i:i + m] != list(range(h, h + m))):
            m = 1  # shorter: block by block
            while i + m < n and hashes[i + m] == h + m and (h + m) & LOW:
                m += 1
        yield h >> SEGMENT_SHIFT, j, m
        i += m
