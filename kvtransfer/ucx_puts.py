"""What a ucx write puts where: the (local address, nbytes, remote address) rows of its
regions, by (source rank, destination rank) (`put_rows`), and how one batch of them is
dealt over the sender's lanes (`plan_lanes`). Address arithmetic only: `ucp_rma.Batch`
issues the rows, `ucx.UcxSender` decides when."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvtransfer import region_rows as rr
from kvtransfer.layout import Pairs, rank_layout
from kvtransfer.memory import RegisteredKV, byte_runs, region_view

_SPLIT_MIN = 1 << 20  # smaller regions travel whole, on one lane
_ALIGN = 4096


def put_rows(kv: RegisteredKV, pairs: Pairs, bases: list[int],
             nbytes: int) -> dict[tuple[int, int], np.ndarray]:
    """The puts of `pairs` (source in `kv`, destination in a receiver whose rank caches
    start at `bases`, `nbytes` each) by (source rank, destination rank): rows of (local
    address, nbytes, remote address), one per byte run (a head slice: one per token,
    neighbours contiguous on both sides merged)."""
    layout = rank_layout(kv.layout, len(bases))
    if not pairs:
        return {}
    src_rows = rr.side_rows(pairs, "src", kv.rank_layout)
    dst_rows = rr.side_rows(pairs, "dst", layout)
    flat = rr.whole_heads(src_rows, kv.rank_layout) & rr.whole_heads(dst_rows, layout)
    if flat.all():  # byte ranges on both sides: every row computed at once
        starts = np.array([int(t.data_ptr()) for t in kv.tensors], dtype=np.int64)
        remote_bases = np.array(bases, dtype=np.int64)
        rows = np.stack([starts[src_rows[:, rr.RANK]] + rr.offsets(src_rows, kv.rank_layout),
                         rr.nbytes(src_rows, kv.rank_layout),
                         remote_bases[dst_rows[:, rr.RANK]] + rr.offsets(dst_rows, layout)],
                        axis=1)
        keys = src_rows[:, rr.RANK] * len(bases) + dst_rows[:, rr.RANK]
        return {(int(k) // len(bases), int(k) % len(bases)): rows[keys == k]
                for k in np.unique(keys)}
    there = torch.empty(layout.tensor_shape(nbytes // layout.block_bytes),
                        dtype=kv.tensor.dtype, device="meta")  # strides only
    parts: dict[tuple[int, int], list[np.ndarray]] = {}
    for src, dst in pairs:
        # byte runs count from the storage's start, as the receiver's bases do
        local = kv.tensors[src.rank].untyped_storage().data_ptr()
        runs = byte_runs(kv.tensor_of(src), region_view(there, dst, layout))
        # columns (source, destination, nbytes) -> (local, nbytes, remote)
        runs = runs[:, [0, 2, 1]] + np.array([local, 0, bases[dst.rank]], dtype=np.int64)
        parts.setdefault((src.rank, dst.rank), []).append(runs)
    return {key: np.concatenate(runs) for key, runs in parts.items()}


def _parts(nbytes: int, lanes: int) -> list[tuple[int, int]]:
    """(offset, nbytes) of each lane's part of a region: page-aligned, near-equal."""
    if lanes == 1 or nbytes < _SPLIT_MIN:
        return [(0, nbytes)]
    step = -(-nbytes // lanes // _ALIGN) * _ALIGN
    return [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]


def plan_lanes(items: Any, lanes: int) -> list[np.ndarray]:
    """Deal (local address, nbytes, remote address) items (rows of an int64 array, or
    tuples) to `lanes` arrays of the same rows: items of `_SPLIT_MIN` bytes or more
    split across every lane, the rest in consecutive stretches that even out the
    lanes' bytes (neighbouring runs stay on one lane, in order)."""
    rows = np.asarray(items, dtype=np.int64).reshape(-1, 3)
    if lanes == 1:
        return [rows]
    big = rows[:, 1] >= _SPLIT_MIN
    plan: list[list[tuple[int, int, int]]] = [[] for _ in range(lanes)]
    load = np.zeros(lanes, dtype=np.int64)
    for local, nbytes, remote in rows[big].tolist():
        for i, (off, n) in enumerate(_parts(nbytes, lanes)):
            plan[i].append((local + off, n, remote + off))
            load[i] += n
    small = rows[~big]
    # Each lane takes small items until it reaches the even share of all bytes:
    # | lane 0's room | lane 1's room | ... |, an item going where its first byte falls.
    share = (int(load.sum()) + int(small[:, 1].sum())) / lanes
    bounds = np.cumsum(np.maximum(share - load, 0))
    starts = np.cumsum(small[:, 1]) - small[:, 1]
    lane_of = np.minimum(np.searchsorted(bounds, starts, side="right"), lanes - 1)
    cuts = np.searchsorted(lane_of, np.arange(1, lanes))
    return [np.concatenate([np.array(p, dtype=np.int64).reshape(-1, 3), part])
            for p, part in zip(plan, np.split(small, cuts), strict=True)]
