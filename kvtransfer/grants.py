"""The cells of an in-place write grant, as both of its sides keep them: per block, a
bit mask of the (rank, head, layer) cells granted and not yet written
(`region_rows.cell_mask`'s bits, as `fencing` counts them).

A grant covers a whole transfer's destination; each write takes its cells out of it,
all or none. The sender takes them before it copies (it writes nowhere it was not
granted, and nowhere twice); the receiver takes them again when the write's WRITTEN
notice names them (what lands is what was granted, once). Torch-free.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kvtransfer import region_rows as rr
from kvtransfer.fencing import slice_mask
from kvtransfer.layout import KVLayout

Cells = dict[int, int]  # block id -> mask of its open cells

# How long after its start bound (`ttl` past the send of the newest request the receiver
# answered) a copy may still write: the sender starts none past the bound, and a copy
# started before it is over within this budget (ucx: its puts stopped, their endpoints
# closed; host: each batch of at most 1024 iovecs starts before the bound; device: one
# chunk's copy behind the forward it waits for). The receiver reuses a revoked grant's
# cells only past the bound, this budget and a margin (`inplace`). The default of
# `TransferConfig.copy_budget_s`, which sender and receiver read.
COPY_BUDGET_S = 2.0


def cells_of(rows: np.ndarray, layout: KVLayout) -> Cells | None:
    """The cells `rows` cover; None if two rows cover the same cell."""
    return cells_of_slices(rr.by_slice(rows), layout)


def cells_of_slices(slices: rr.Slices, layout: KVLayout) -> Cells | None:
    """`cells_of` of rows grouped by `by_slice` (or `checked_slices`)."""
    cells: Cells = {}
    for key, blocks in slices:
        mask = slice_mask(layout, key)
        if not cells and len(set(blocks)) == len(blocks):
            cells = dict.fromkeys(blocks, mask)
            continue
        for b in blocks:
            have = cells.get(b, 0)
            if have & mask:
                return None
            cells[b] = have | mask
    return cells


def take(cells: Cells, rows: np.ndarray, layout: KVLayout) -> bool:
    """Takes the cells `rows` cover out of `cells` if every one of them is there (and
    no two rows cover the same one); False, leaving `cells` as it was, otherwise."""
    return take_slices(cells, rr.by_slice(rows), layout) is not None


def take_slices(cells: Cells, slices: rr.Slices, layout: KVLayout) -> int | None:
    """`take` of rows grouped by `by_slice` (or `checked_slices`): how many cells it
    took, or None, leaving `cells` as it was."""
    if len(slices) == 1:  # a chunk of whole blocks: one mask, dict operations in C
        key, blocks = slices[0]
        mask = slice_mask(layout, key)
        try:
            have = list(map(cells.__getitem__, blocks))
        except KeyError:
            return None
        kinds = set(have)
        if len(set(blocks)) < len(blocks) or any(h & mask != mask for h in kinds):
            return None
        if kinds == {mask}:  # the blocks' last open cells (a grant of whole blocks)
            deque(map(cells.__delitem__, blocks), maxlen=0)
        else:
            for b, h in zip(blocks, have, strict=True):
                if h == mask:
                    del cells[b]
                else:
                    cells[b] = h & ~mask
        return mask.bit_count() * len(blocks)
    want = cells_of_slices(slices, layout)
    if want is None or any(cells.get(b, 0) & m != m for b, m in want.items()):
        return None
    for b, m in want.items():
        left = cells[b] & ~m
        if left:
            cells[b] = left
        else:
            del cells[b]
    return sum(map(int.bit_count, want.values()))


def add(cells: Cells, more: Cells) -> None:
    """Adds the cells `more` holds to `cells` (a grant extended)."""
    for b, m in more.items():
        cells[b] = cells.get(b, 0) | m


def covers(cells: Cells, want: Cells) -> bool:
    """Whether every cell of `want` is in `cells`."""
    return all(cells.get(b, 0) & m == m for b, m in want.items())
