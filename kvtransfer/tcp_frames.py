"""The `tcp` transport's WRITE frame: one frame per chunk (a bounded batch of regions),
its regions as rows of one int64 array (`region_rows`), the payload after it.

    meta:    | generation u64 | flags u8 | n u32 | rows: n x 7 int64 | checksums: n x u64 |
             | xfer id (utf-8) |                        (checksums only with FLAG_CHECKSUM)
    payload: each row's bytes in row order (a head slice's runs packed, `payload` order)

Rows are in the receiver's rank layout with their open ends resolved. The receiver
admits the whole table at once (fencing, bounds, cells expected and unclaimed) and
checks that the payload is the rows' total before a byte lands; then it receives the
payload straight into the destination blocks, one receive loop per run of rows that are
adjacent in its cache (`runs`). A scattered hand-off of whole blocks from a prefill's
consecutive blocks is one byte range on the sender and one range per block on the
receiver.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtransfer import region_rows as rr
from kvtransfer.errors import ProtocolError
from kvtransfer.layout import KVLayout
from kvtransfer.memory import checksum

WRITE_HEAD = struct.Struct("!QBI")  # generation, flags, rows
FLAG_CHECKSUM = 1
_ROW = np.dtype(">i8")
_SUM = np.dtype(">u8")
_ROW_BYTES = 7 * _ROW.itemsize
# A frame holds at most this many payload bytes (at least one row) and rows: the send
# lock is per frame, so concurrent transfers to one receiver interleave frame by frame.
FRAME_BYTES = 16 << 20
FRAME_ROWS = 4096


@dataclass(frozen=True, slots=True)
class WriteHead:
    """The meta of one WRITE frame: which cells of which transfer its payload fills."""

    xfer_id: str
    generation: int
    rows: np.ndarray  # [n, 7] int64 (`region_rows`), the receiver's rank layout
    checksums: np.ndarray | None = None  # [n] uint64: xxh3-64 of each row's bytes

    def pack(self) -> bytes:
        flags = FLAG_CHECKSUM if self.checksums is not None else 0
        parts = [WRITE_HEAD.pack(self.generation, flags, len(self.rows)),
                 np.ascontiguousarray(self.rows, dtype=_ROW).tobytes()]
        if self.checksums is not None:
            parts.append(np.ascontiguousarray(self.checksums, dtype=_SUM).tobytes())
        parts.append(self.xfer_id.encode())
        return b"".join(parts)

    @classmethod
    def unpack(cls, meta: bytes) -> WriteHead:
        """ProtocolError for meta that is not a WRITE head (short, unknown flags, an id
        that is not utf-8)."""
        if len(meta) < WRITE_HEAD.size:
            raise ProtocolError("short WRITE header")
        generation, flags, n = WRITE_HEAD.unpack_from(meta)
        if flags & ~FLAG_CHECKSUM:
            raise ProtocolError(f"WRITE header with unknown flags {flags:#x}")
        at = WRITE_HEAD.size
        sums_at = at + n * _ROW_BYTES
        end = sums_at + (n * _SUM.itemsize if flags & FLAG_CHECKSUM else 0)
        if len(meta) < end:
            raise ProtocolError(f"WRITE header of {len(meta)} bytes for {n} rows")
        rows = np.frombuffer(meta, _ROW, 7 * n, at).astype(np.int64).reshape(n, 7)
        sums = np.frombuffer(meta, _SUM, n, sums_at).astype(np.uint64) \
            if flags & FLAG_CHECKSUM else None
        try:
            xfer_id = meta[end:].decode()
        except UnicodeDecodeError:
            raise ProtocolError("WRITE header with a transfer id that is not utf-8") from None
        return cls(xfer_id, generation, rows, sums)


def runs(rows: np.ndarray, sizes: np.ndarray, layout: KVLayout) -> list[tuple[int, int, int, int]]:
    """The rows as byte ranges of their rank caches: (first row, end row, rank, offset),
    consecutive whole-head rows that follow each other in one rank's cache merged into
    one range; a head slice (strided, no one range) is a run of its own, offset -1.

        cache:  | row 3 | row 4 | ... | row 0 | row 1 | row 2 |
        runs:   (0, 3, rank, off of row 0), (3, 5, rank, off of row 3)
    """
    if len(rows) <= rr.FEW:  # fewer calls one row at a time than numpy's
        return _few_runs(rows.tolist(), sizes.tolist(), layout)
    whole = rr.whole_heads(rows, layout)
    offs = rr.offsets(rows, layout)
    rank = rows[:, rr.RANK]
    # | row i-1 | row i |: row i continues row i-1's range
    joined = whole[1:] & whole[:-1] & (rank[1:] == rank[:-1]) \
        & (offs[1:] == offs[:-1] + sizes[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    ends = np.append(starts[1:], len(rows))
    return [(s, e, r, o if w else -1) for s, e, r, o, w in zip(
        starts.tolist(), ends.tolist(), rank[starts].tolist(), offs[starts].tolist(),
        whole[starts].tolist(), strict=True)]


def _few_runs(rows: list[list[int]], sizes: list[int],
              layout: KVLayout) -> list[tuple[int, int, int, int]]:
    """`runs` of a few rows, one at a time."""
    out: list[tuple[int, int, int, int]] = []
    layer_bytes = layout.layer_bytes
    follows = -1  # the offset a row must start at to continue the last run
    for i, (block, start, _, _, rank, first, last) in enumerate(rows):
        whole = first == 0 and last == layout.num_kv_heads
        off = (block * layout.num_layers + start) * layer_bytes if whole else -1
        if whole and off == follows and out[-1][2] == rank:
            out[-1] = (out[-1][0], i + 1, rank, out[-1][3])
        else:
            out.append((i, i + 1, rank, off))
        follows = off + sizes[i] if whole else -1
    return out


def batches(sizes: np.ndarray, max_bytes: int = FRAME_BYTES,
            max_rows: int = FRAME_ROWS) -> list[tuple[int, int]]:
    """[start, end) row ranges of the frames that carry rows of `sizes` bytes, in order:
    each at most `max_bytes` of payload (or one row) and `max_rows` rows."""
    if len(sizes) <= max_rows and (len(sizes) <= 1 or int(sizes.sum()) <= max_bytes):
        return [(0, len(sizes))] if len(sizes) else []
    out: list[tuple[int, int]] = []
    total = np.cumsum(sizes)
    start = 0
    while start < len(sizes):
        base = int(total[start - 1]) if start else 0
        fit = int(np.searchsorted(total, base + max_bytes, side="right"))
        end = min(max(fit, start + 1), start + max_rows, len(sizes))
        out.append((start, end))
        start = end
    return out


def row_checksums(run: Any, sizes: np.ndarray, first: int, end: int,
                  sums: np.ndarray) -> None:
    """Each row's checksum over its bytes in `run`, the bytes of rows [first, end) laid
    end to end, into `sums` (one per row)."""
    at = 0
    for i, k in enumerate(sizes[first:end].tolist(), first):
        sums[i] = checksum(run[at:at + k])
        at += k
