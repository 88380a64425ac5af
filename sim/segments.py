"""The in-process index's device tier, segment by segment (sim/index.py): a block
hash is `segment << SEGMENT_SHIFT | block's number in the segment` (sim/workload.py), a
segment's holders are bitmaps (`Segment`), and a batch of hashes is walked as runs of
consecutive blocks of one segment (`runs_of`, `runs_of_lazily`), one OR / AND per run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Final

# A hash (an int: sim/workload.py's) = segment << this | block number. Small, so that
# the segment is in a hash's low bits: CPython's dicts (the block pools' prefix maps)
# start probing at hash & (size - 1), and with 21 bits of block number every key of a
# map started in the same 32 slots (3-4 probes, each a cache miss, per lookup).
SEGMENT_SHIFT: Final = 5
LOW: Final = (1 << SEGMENT_SHIFT) - 1


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
    hs: list[int] = hashes if isinstance(hashes, list) else list(hashes)
    if not ordered:
        return _sorted_runs(hs)
    out = []  # runs_of_lazily's loop, without a generator's resumes
    i, n = 0, len(hs)
    while i < n:
        h = hs[i]
        j = h & LOW
        lim = min(LOW + 1 - j, n - i)
        k = 1
        while k < lim and hs[i + k] == h + k:
            k += 1
        out.append((h >> SEGMENT_SHIFT, j, k))
        i += k
    return out


def _sorted_runs(hs: list[int]) -> list[tuple[int, int, int]]:
    """`runs_of(sorted(hs))` without sorting the blocks: the runs found as they come,
    up or down (a request's blocks freed tail first are evicted in runs going down),
    then the runs sorted and the adjacent ones in a segment joined. Runs that overlap
    (a block twice: evicted, cached again and evicted in one batch) sort the blocks."""
    found: list[tuple[int, int]] = []  # (first block's hash, count)
    i, n = 0, len(hs)
    while i < n:
        h = hs[i]
        k = 1
        if i + 1 < n and hs[i + 1] == h - 1 and h & LOW:  # down, to the segment's start
            lim = min((h & LOW) + 1, n - i)
            while k < lim and hs[i + k] == h - k:
                k += 1
            found.append((h - k + 1, k))
        else:
            lim = min(LOW + 1 - (h & LOW), n - i)
            while k < lim and hs[i + k] == h + k:
                k += 1
            found.append((h, k))
        i += k
    found.sort()
    out: list[tuple[int, int, int]] = []
    end = 0
    for first, k in found:
        if out and first < end:  # overlaps the run before
            return list(runs_of_lazily(sorted(hs)))
        if out and first == end and first & LOW:  # goes on from the run before
            c, j, m = out[-1]
            out[-1] = (c, j, m + k)
        else:
            out.append((first >> SEGMENT_SHIFT, first & LOW, k))
        end = first + k
    return out


def runs_of_lazily(hashes: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """`runs_of(hashes)` one run at a time, for a walk that may stop after a few."""
    hs: list[int] = hashes if isinstance(hashes, list) else list(hashes)
    i, n = 0, len(hs)
    while i < n:
        h = hs[i]
        j = h & LOW
        lim = min(LOW + 1 - j, n - i)  # the longest run here: to its segment's end
        k = 1
        while k < lim and hs[i + k] == h + k:
            k += 1
        yield h >> SEGMENT_SHIFT, j, k
        i += k
