"""The tcp WRITE frame's codec (`kvtransfer.tcp_frames`): the row table survives the
wire exactly, a malformed header is a ProtocolError, runs merge exactly the rows that
are one byte range of the cache, frames keep to their bounds."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtransfer import KVLayout, Region
from kvtransfer import region_rows as rr
from kvtransfer.errors import ProtocolError
from kvtransfer.tcp_frames import WRITE_HEAD, WriteHead, _few_runs, batches, runs

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")


def rows(*regions: Region) -> np.ndarray:
    return rr.rows_of(regions, LAYOUT)


def test_head_round_trips_rows_checksums_and_id() -> None:
    table = rows(Region(7), Region(3, 1, 3), Region(40, num_blocks=5), Region(2, rank=1,
                                                                          head_start=1))
    sums = np.array([0, 1, 2**64 - 1, 12345], dtype=np.uint64)
    for checksums in (sums, None):
        head = WriteHead("req-ü-1", 2**40 + 3, table, checksums)
        back = WriteHead.unpack(head.pack())
        assert (back.xfer_id, back.generation) == ("req-ü-1", 2**40 + 3)
        assert back.rows.dtype == np.int64 and np.array_equal(back.rows, table)
        if checksums is None:
            assert back.checksums is None
        else:
            assert back.checksums is not None and back.checksums.tolist() == sums.tolist()
    many = rr.rows_of([Region(b) for b in range(3000)], LAYOUT)
    assert np.array_equal(WriteHead.unpack(WriteHead("x", 1, many).pack()).rows, many)


def test_malformed_heads_are_protocol_errors() -> None:
    good = WriteHead("x", 1, rows(Region(1), Region(2)), np.array([1, 2], np.uint64)).pack()
    with pytest.raises(ProtocolError, match="short"):
        WriteHead.unpack(good[:WRITE_HEAD.size - 1])
    with pytest.raises(ProtocolError, match="for 2 rows"):  # rows cut short
        WriteHead.unpack(good[:WRITE_HEAD.size + 7 * 8 + 3])
    with pytest.raises(ProtocolError, match="for 2 rows"):  # checksums cut short
        WriteHead.unpack(good[:WRITE_HEAD.size + 2 * 7 * 8 + 8])
    with pytest.raises(ProtocolError, match="flags"):
        WriteHead.unpack(good[:8] + bytes([0x81]) + good[9:])
    more = WRITE_HEAD.pack(1, 0, 3) + good[WRITE_HEAD.size:]  # says 3 rows, holds 2 + sums
    with pytest.raises(ProtocolError, match="for 3 rows"):
        WriteHead.unpack(more[:WRITE_HEAD.size + 2 * 7 * 8])
    with pytest.raises(ProtocolError, match="utf-8"):
        WriteHead.unpack(WriteHead("x", 1, rows(Region(1))).pack()[:-1] + b"\xff")


def test_runs_merge_what_is_one_byte_range() -> None:
    table = rows(Region(4), Region(5), Region(6, num_blocks=2),  # one range, 4 blocks
                 Region(3),  # before them: a run of its own
                 Region(9, 0, 2), Region(9, 2, 4), Region(10, 0, 1),  # layers 0-1, 2-3, next
                 Region(11, rank=1), Region(12, rank=0),  # another rank, then back
                 Region(13, head_start=1), Region(14, head_start=1))  # head slices
    sizes = rr.nbytes(table, LAYOUT)
    got = runs(table, sizes, LAYOUT)
    offs = rr.offsets(table, LAYOUT).tolist()
    assert got == [(0, 3, 0, offs[0]), (3, 4, 0, offs[3]), (4, 7, 0, offs[4]),
                   (7, 8, 1, offs[7]), (8, 9, 0, offs[8]), (9, 10, 0, -1), (10, 11, 0, -1)]
    # each run is the rows' bytes, back to back in its rank's cache
    for first, end, _, off in got:
        if off >= 0:
            assert off + int(sizes[first:end].sum()) == offs[end - 1] + int(sizes[end - 1])
    assert runs(table[:0], sizes[:0], LAYOUT) == []


def test_runs_of_random_scattered_blocks_cover_every_row_once() -> None:
    rng = random.Random(3)
    blocks = rng.sample(range(200), 120)
    table = rows(*(Region(b) for b in blocks))
    got = runs(table, rr.nbytes(table, LAYOUT), LAYOUT)
    assert [r for s, e, _, _ in got for r in range(s, e)] == list(range(len(blocks)))
    for s, e, _, _ in got:
        assert blocks[s:e] == list(range(blocks[s], blocks[s] + e - s))
    joined = sum(b == a + 1 for a, b in zip(blocks, blocks[1:], strict=False))
    assert len(got) == len(blocks) - joined


def test_runs_a_few_rows_at_a_time_are_numpys() -> None:
    """Up to FEW rows `runs` goes one row at a time: the same runs as numpy's (both
    held to each other on longer tables)."""
    rng = random.Random(5)
    for _ in range(300):
        block, regions = rng.randrange(50), []
        for _ in range(rng.randrange(rr.FEW + 1, 30)):
            block = block + 1 if rng.random() < 0.5 else rng.randrange(60)
            whole = rng.random() < 0.8
            regions.append(Region(block, 0, None, 1, rng.choice([0, 0, 0, 1]),
                                  0 if whole else 1))
        table = rows(*regions)
        sizes = rr.nbytes(table, LAYOUT)
        assert runs(table, sizes, LAYOUT) == _few_runs(table.tolist(), sizes.tolist(), LAYOUT)


def test_batches_keep_to_their_bounds() -> None:
    sizes = np.array([10, 10, 10, 50, 10, 10], dtype=np.int64)
    assert batches(sizes, max_bytes=30, max_rows=100) == [(0, 3), (3, 4), (4, 6)]
    assert batches(sizes, max_bytes=1000, max_rows=4) == [(0, 4), (4, 6)]
    assert batches(sizes, max_bytes=5, max_rows=100) == [(i, i + 1) for i in range(6)]
    assert batches(sizes[:0]) == []
    one_chunk = np.full(512, 32 << 10, dtype=np.int64)  # an 8k-token prompt, 32 KiB blocks
    assert batches(one_chunk) == [(0, 512)]
