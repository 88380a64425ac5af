"""Regions as rows of one int64 array: the per-region bookkeeping of a hand-off done
by numpy over all of them at once.

A scattered hand-off is one region per block (an 8k-token prompt: 512 regions per
write); checking, sizing and locating them one `Region` object at a time costs several
microseconds each on both sides. A row is the region with its open ends resolved
against the layout:

    | block_id | layer_start | layer_end | num_blocks | rank | head_start | head_end |

Every function here gives what the same `Region` method gives for each row (the
tests hold them to that); torch-free, like `kvtransfer.layout`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import Any

import numpy as np

from kvtransfer.layout import KVLayout, Region, WholeBlocks

BLOCK, LAYER_START, LAYER_END, NUM_BLOCKS, RANK, HEAD_START, HEAD_END = range(7)
# the columns that say which cells of each of its blocks a row covers
SLICE = [LAYER_START, LAYER_END, RANK, HEAD_START, HEAD_END]
# Up to this many rows, one Region at a time costs less than numpy's per-call overhead
FEW = 8
# Up to this many whole blocks, `BlockPairs.of` finds their runs on plain ints
_PY_RUNS = 64
# rows grouped by the cells they cover in each block (`by_slice`): [(slice columns of a
# row, every block id of the group's rows)]
Slices = list[tuple[tuple[int, ...], list[int]]]
Bounds = tuple[list[int], list[int]]  # each column's least and greatest value


def rows_of(regions: Iterable[Region], layout: KVLayout) -> np.ndarray:
    """[n, 7] int64: `regions` with `layer_end` / `head_end` None resolved."""
    layers, heads = layout.num_layers, layout.num_kv_heads
    if isinstance(regions, WholeBlocks):
        return block_rows(np.asarray(regions.ids, dtype=np.int64), None, layout)
    flat = [(r.block_id, r.layer_start, layers if r.layer_end is None else r.layer_end,
             r.num_blocks, r.rank, r.head_start, heads if r.head_end is None else r.head_end)
            for r in regions]
    # (numpy reads a flat iterator of ints faster than a list of tuples)
    return np.fromiter(chain.from_iterable(flat), dtype=np.int64,
                       count=7 * len(flat)).reshape(-1, 7)


def block_rows(first: np.ndarray, counts: np.ndarray | None, layout: KVLayout) -> np.ndarray:
    """[n, 7] int64: runs of whole blocks (every layer and head of rank 0) from block
    ids `first`, `counts` blocks each (None: one each)."""
    rows = np.zeros((len(first), 7), dtype=np.int64)
    rows[:, BLOCK] = first
    rows[:, LAYER_END] = layout.num_layers
    rows[:, NUM_BLOCKS] = 1 if counts is None else counts
    rows[:, HEAD_END] = layout.num_kv_heads
    return rows


class BlockPairs(Sequence[tuple[Region, Region]]):
    """The (source, destination) pairs of a write of whole blocks (`WholeBlocks` on
    both sides): runs of blocks consecutive on both sides, as first block ids and
    counts (plain ints), each pair of `Region`s made only when it is read. `rows`
    gives either side's rows without making one (`side_rows`)."""

    __slots__ = ("src", "dst", "counts")

    def __init__(self, src: list[int], dst: list[int], counts: list[int]) -> None:
        self.src, self.dst, self.counts = src, dst, counts

    @classmethod
    def of(cls, src_ids: Sequence[int], dst_ids: Sequence[int]) -> BlockPairs:
        """Blocks `src_ids[i]` to `dst_ids[i]`, coalesced: the runs `coalesce` makes
        of single whole blocks. ValueError if the two differ in length."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source regions but {len(dst_ids)} "
                             "destination regions")
        if len(src_ids) <= _PY_RUNS:  # plain ints: less than numpy's per-call cost
            src: list[int] = []
            dst: list[int] = []
            counts: list[int] = []
            next_s = next_d = None
            for s, d in zip(src_ids, dst_ids, strict=True):
                if s == next_s and d == next_d:
                    counts[-1] += 1
                else:
                    src.append(s)
                    dst.append(d)
                    counts.append(1)
                next_s, next_d = s + 1, d + 1
            return cls(src, dst, counts)
        sa = np.asarray(src_ids, dtype=np.int64)
        da = np.asarray(dst_ids, dtype=np.int64)
        breaks = (sa[1:] != sa[:-1] + 1) | (da[1:] != da[:-1] + 1)
        starts = np.flatnonzero(np.concatenate(([True], breaks)))
        return cls(sa[starts].tolist(), da[starts].tolist(),
                   np.diff(np.append(starts, len(sa))).tolist())

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return BlockPairs(self.src[i], self.dst[i], self.counts[i])
        n = self.counts[i]
        return Region(self.src[i], num_blocks=n), Region(self.dst[i], num_blocks=n)

    def __iter__(self) -> Iterator[tuple[Region, Region]]:
        for s, d, n in zip(self.src, self.dst, self.counts, strict=True):
            yield Region(s, num_blocks=n), Region(d, num_blocks=n)

    def rows(self, side: str, layout: KVLayout) -> np.ndarray:
        """The rows of the `"src"` or `"dst"` regions."""
        return block_rows(np.asarray(self.src if side == "src" else self.dst,
                                     dtype=np.int64), np.asarray(self.counts), layout)

    def block_ids(self, side: str) -> list[int]:
        """Every block id of the `"src"` or `"dst"` side, in order."""
        first = self.src if side == "src" else self.dst
        if len(first) == sum(self.counts):
            return first
        return [b + i for b, n in zip(first, self.counts, strict=True) for i in range(n)]


def side_rows(pairs: Sequence[tuple[Region, Region]], side: str,
              layout: KVLayout) -> np.ndarray:
    """The rows of a write's `"src"` or `"dst"` regions: read off a `BlockPairs`, else
    made from each `Region`."""
    if isinstance(pairs, BlockPairs):
        return pairs.rows(side, layout)
    at = 0 if side == "src" else 1
    return rows_of((p[at] for p in pairs), layout)


def byte_ranges(rows: np.ndarray, layout: KVLayout) -> list[tuple[int, int, int]] | None:
    """(rank, byte offset, nbytes) of each row in its rank's cache, or None where a row
    is a head slice (no one byte range). Rows checked (`check_rows`) first."""
    if len(rows) <= FEW:  # on plain ints
        heads, layer_bytes = layout.num_kv_heads, layout.layer_bytes
        block_bytes = layout.num_layers * layer_bytes
        out = []
        for b, ls, le, n, rank, hs, he in rows.tolist():
            if hs != 0 or he != heads:
                return None
            out.append((rank, b * block_bytes + ls * layer_bytes,
                        (n * block_bytes) if n > 1 else (le - ls) * layer_bytes))
        return out
    if not whole_heads(rows, layout).all():
        return None
    return list(zip(rows[:, RANK].tolist(), offsets(rows, layout).tolist(),
                    nbytes(rows, layout).tolist(), strict=True))


def pack_rows(rows: np.ndarray) -> bytes:
    """`rows` as a RESERVE or WRITTEN frame's payload carries them: their little-endian
    int64 bytes (a scattered chunk's 512 rows: 28 KiB, read back with one `frombuffer`)."""
    return np.ascontiguousarray(rows, dtype="<i8").tobytes()


def coalesce_rows(rows: np.ndarray, layout: KVLayout) -> np.ndarray:
    """`rows` with each run of whole-layer rows over consecutive blocks (the same cells
    of each) as one row of `num_blocks` blocks: what a RESERVE carries."""
    if len(rows) < 2:
        return rows
    whole = (rows[:, LAYER_START] == 0) & (rows[:, LAYER_END] == layout.num_layers)
    joins = ((rows[1:, SLICE] == rows[:-1, SLICE]).all(axis=1)
             & (rows[1:, BLOCK] == rows[:-1, BLOCK] + rows[:-1, NUM_BLOCKS])
             & whole[1:] & whole[:-1])
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    out = rows[starts].copy()
    out[:, NUM_BLOCKS] = np.add.reduceat(rows[:, NUM_BLOCKS], starts)
    return out


def one_per_block(rows: np.ndarray) -> np.ndarray:
    """`rows` with each row of several blocks split into one row per block."""
    counts = rows[:, NUM_BLOCKS]
    out = np.repeat(rows, counts, axis=0)
    firsts = np.cumsum(counts) - counts
    out[:, BLOCK] += np.arange(len(out)) - np.repeat(firsts, counts)
    out[:, NUM_BLOCKS] = 1
    return out


def rows_from_wire(raw: Any) -> np.ndarray:
    """The rows `pack_rows` packed, over `raw`'s own memory (not copied: the caller
    leaves it as it is while it uses them). ValueError for anything else (not bytes of
    whole rows). Every field is an int64 by construction; `check_rows` says whether the
    rows lie in a cache."""
    if not isinstance(raw, (bytes, bytearray)):
        raise ValueError("regions must be packed rows (bytes)")
    if len(raw) % (7 * 8):
        raise ValueError("regions must be seven int64 fields each")
    # (int64 is '<i8' on a little-endian host: no copy; a big-endian one converts)
    return np.frombuffer(raw, dtype="<i8").reshape(-1, 7).astype(np.int64, copy=False)


def to_regions(rows: np.ndarray, layout: KVLayout) -> list[Region]:
    """The `Region`s of `rows`, open ends None again where they cover everything."""
    layers, heads = layout.num_layers, layout.num_kv_heads
    return [Region(b, ls, None if le == layers else le, n, rank, hs,
                   None if he == heads else he)
            for b, ls, le, n, rank, hs, he in rows.tolist()]


def check_rows(rows: np.ndarray, layout: KVLayout, total_blocks: int, tp: int = 1) -> None:
    """`Region.check` of every row: ValueError (that of the first bad row) unless all
    lie in `tp` rank caches of `total_blocks` blocks of `layout`."""
    if len(rows) <= FEW:
        _check_few(rows, layout, total_blocks, tp)
    elif not _bounds_hold(_column_bounds(rows), layout, total_blocks, tp):
        _check_each(rows, layout, total_blocks, tp)


def checked_slices(rows: np.ndarray, layout: KVLayout, total_blocks: int,
                   tp: int = 1) -> Slices:
    """`check_rows`, then `by_slice`, with the columns of `rows` reduced once for both
    (a scattered chunk's bounds alone prove its rows in the cache): what a WRITTEN
    notice needs on its way to the verdict."""
    if len(rows) <= FEW:
        _check_few(rows, layout, total_blocks, tp)
        return by_slice(rows)
    bounds = _column_bounds(rows)
    if not _bounds_hold(bounds, layout, total_blocks, tp):
        _check_each(rows, layout, total_blocks, tp)
    return _by_slice(rows, bounds)


def _check_few(rows: np.ndarray, layout: KVLayout, total_blocks: int, tp: int) -> None:
    """`check_rows` of at most FEW rows: its rule on plain ints, no Region, no numpy
    call per row."""
    layers, heads = layout.num_layers, layout.num_kv_heads
    for row in rows.tolist():
        block, start, end, n, rank, first, last = row
        if not (0 <= rank < tp and 0 <= first < last <= heads and 0 <= start < end <= layers
                and 1 <= n and 0 <= block <= total_blocks - n
                and (n == 1 or (start == 0 and end == layers))):
            _raise_outside(np.array([row], dtype=np.int64), layout, total_blocks, tp)


def _check_each(rows: np.ndarray, layout: KVLayout, total_blocks: int, tp: int) -> None:
    """`check_rows` row by row, elementwise over the columns: for rows whose bounds
    (`_bounds_hold`) do not prove them in the cache."""
    r = rows.T
    ok = ((r[RANK] >= 0) & (r[RANK] < tp) & (r[HEAD_START] >= 0)
          & (r[HEAD_START] < r[HEAD_END]) & (r[HEAD_END] <= layout.num_kv_heads)
          & (r[LAYER_START] >= 0) & (r[LAYER_START] < r[LAYER_END])
          & (r[LAYER_END] <= layout.num_layers) & (r[NUM_BLOCKS] >= 1) & (r[BLOCK] >= 0)
          & (r[BLOCK] <= total_blocks - r[NUM_BLOCKS])  # (no int64 overflow)
          & ((r[NUM_BLOCKS] == 1) | ((r[LAYER_START] == 0)
                                     & (r[LAYER_END] == layout.num_layers))))
    if not ok.all():
        _raise_outside(rows[int(np.argmin(ok))][None], layout, total_blocks, tp)


def _bounds_hold(bounds: Bounds, layout: KVLayout, total_blocks: int, tp: int) -> bool:
    """Whether each column's least and greatest value (`_column_bounds`) alone prove
    every row in the cache: two reductions instead of a dozen elementwise passes.
    False says nothing; `_check_each` then checks row by row."""
    lo, hi = bounds
    layers, heads = layout.num_layers, layout.num_kv_heads
    return (0 <= lo[RANK] and hi[RANK] < tp and 0 <= lo[HEAD_START]
            and hi[HEAD_START] < lo[HEAD_END] and hi[HEAD_END] <= heads
            and 0 <= lo[LAYER_START] and hi[LAYER_START] < lo[LAYER_END]
            and hi[LAYER_END] <= layers and 1 <= lo[NUM_BLOCKS] and 0 <= lo[BLOCK]
            and hi[BLOCK] + hi[NUM_BLOCKS] <= total_blocks  # Python ints: no overflow
            and (hi[NUM_BLOCKS] == 1 or (hi[LAYER_START] == 0 and lo[LAYER_END] == layers)))


def _column_bounds(rows: np.ndarray) -> Bounds:
    """Each column's least and greatest value (rows: at least one). Reduced along the
    rows of a transposed copy: over seven columns, a reduction along axis 0 runs 2-4x
    slower."""
    columns = np.ascontiguousarray(rows.T)
    return columns.min(axis=1).tolist(), columns.max(axis=1).tolist()


def _raise_outside(bad: np.ndarray, layout: KVLayout, total_blocks: int, tp: int) -> None:
    """The ValueError `Region.check` raises for the one row `bad` that `check_rows`
    refused."""
    to_regions(bad, layout)[0].check(layout, total_blocks, tp)
    raise ValueError(f"{bad[0].tolist()} lies outside the cache")  # not reached


def whole_heads(rows: np.ndarray, layout: KVLayout) -> np.ndarray:
    """`Region.whole_heads` per row: where the row is one byte range of its rank."""
    return (rows[:, HEAD_START] == 0) & (rows[:, HEAD_END] == layout.num_kv_heads)


def cells_and_bytes(rows: np.ndarray, layout: KVLayout) -> tuple[int, int]:
    """(cells, bytes) the rows cover in all: what `fencing` counts as landed."""
    if len(rows) <= FEW:
        cells = [n * (le - ls) * (he - hs) for _, ls, le, n, _, hs, he in rows.tolist()]
        return sum(cells), sum(cells) * layout.layer_bytes // layout.num_kv_heads
    counts = rows[:, NUM_BLOCKS] * (rows[:, LAYER_END] - rows[:, LAYER_START]) \
        * (rows[:, HEAD_END] - rows[:, HEAD_START])
    total = int(counts.sum())
    return total, total * layout.layer_bytes // layout.num_kv_heads


def nbytes(rows: np.ndarray, layout: KVLayout) -> np.ndarray:
    """`Region.nbytes` per row."""
    return (rows[:, NUM_BLOCKS] * (rows[:, LAYER_END] - rows[:, LAYER_START])
            * layout.layer_bytes * (rows[:, HEAD_END] - rows[:, HEAD_START])
            // layout.num_kv_heads)


def offsets(rows: np.ndarray, layout: KVLayout) -> np.ndarray:
    """Byte offset of each row in its rank's cache (`Region.resolve`'s first value;
    meaningful for whole-head rows)."""
    layer_bytes = layout.layer_bytes
    return rows[:, BLOCK] * (layout.num_layers * layer_bytes) \
        + rows[:, LAYER_START] * layer_bytes


def cell_mask(row: Sequence[int], layout: KVLayout) -> int:
    """The cells of one block that `row` covers, as `fencing` counts them: bit
    (rank * heads + head) * layers + layer."""
    _, start, end, _, rank, first, last = row
    layers = ((1 << (end - start)) - 1) << start
    mask = 0
    for head in range(rank * layout.num_kv_heads + first, rank * layout.num_kv_heads + last):
        mask |= layers << (head * layout.num_layers)
    return mask


def by_slice(rows: np.ndarray) -> Slices:
    """Rows grouped by the cells they cover in each block: [(a row's slice columns,
    every block id of the group's rows, in row order)]. A scattered hand-off of whole
    blocks is one group."""
    if len(rows) <= FEW:  # grouped on plain ints: fewer calls than numpy's grouping
        few: dict[tuple[int, ...], list[int]] = {}
        for b, ls, le, n, rank, hs, he in rows.tolist():
            few.setdefault((ls, le, rank, hs, he), []).extend(range(b, b + n))
        return list(few.items())
    return _by_slice(rows, _column_bounds(rows))


def _by_slice(rows: np.ndarray, bounds: Bounds) -> Slices:
    """`by_slice` of more than FEW rows, whose `_column_bounds` are `bounds`."""
    lo, hi = bounds
    if all(lo[c] == hi[c] for c in SLICE):  # one group (a scattered hand-off's)
        blocks = rows[:, BLOCK] if hi[NUM_BLOCKS] == 1 else block_ids(rows)
        return [(tuple(lo[c] for c in SLICE), blocks.tolist())]
    uniq, inverse = np.unique(rows[:, SLICE], axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    return [(tuple(uniq[g].tolist()), block_ids(rows[inverse == g]).tolist())
            for g in range(len(uniq))]


def block_ids(rows: np.ndarray) -> np.ndarray:
    """Every block id the rows cover, row by row."""
    counts = rows[:, NUM_BLOCKS]
    if (counts == 1).all():
        return rows[:, BLOCK].copy()
    starts = np.repeat(rows[:, BLOCK] - np.cumsum(counts) + counts, counts)
    return starts + np.arange(int(counts.sum()), dtype=np.int64)


def slice_row(key: tuple[int, ...]) -> tuple[int, ...]:
    """A row (block 0, one block) of a `by_slice` key, for `cell_mask`."""
    start, end, rank, first, last = key
    return (0, start, end, 1, rank, first, last)

