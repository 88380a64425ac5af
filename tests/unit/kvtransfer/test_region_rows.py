"""Regions as numpy rows (`kvtransfer.region_rows`) and the table's batched admission,
held to the per-region and per-cell definitions they replace on the hot path."""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest

from kvtransfer import KVLayout, Region, grants
from kvtransfer import region_rows as rr
from kvtransfer.errors import ProtocolError
from kvtransfer.fencing import TransferTable
from kvtransfer.metrics import TransferMetrics

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
BLOCKS = 64


def random_region(rng: random.Random, tp: int = 2) -> Region:
    """Mostly valid regions, some outside the cache in each way a field can be."""
    n = rng.choice([1, 1, 1, 2, 3])
    start = 0 if n > 1 and rng.random() < 0.9 else rng.randrange(-1, 4)
    end = rng.choice([None, None, rng.randrange(0, 6)])
    first = rng.choice([0, 0, rng.randrange(-1, 3)])
    return Region(rng.randrange(-1, BLOCKS + 1), start, end, n, rng.choice([0, 0, 1, tp]),
                  first, rng.choice([None, None, rng.randrange(0, 4)]))


def cells(region: Region, layout: KVLayout) -> set[tuple[int, int]]:
    """(block, cell bit) of every cell `region` covers, one by one."""
    start, end = region.layers(layout)
    first, last = region.heads(layout)
    return {(b, (region.rank * layout.num_kv_heads + h) * layout.num_layers + layer)
            for b in range(region.block_id, region.block_id + region.num_blocks)
            for h in range(first, last) for layer in range(start, end)}


def check_error(region: Region, tp: int) -> str | None:
    try:
        region.check(LAYOUT, BLOCKS, tp)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("n", [1, rr.FEW, rr.FEW + 1, 200])
def test_rows_agree_with_each_region(n: int) -> None:
    rng = random.Random(n)
    checked = 0
    for trial in range(40):
        regions = [random_region(rng) for _ in range(n)]
        while trial % 2 and len(regions) > len(valid := [
                r for r in regions if check_error(r, 2) is None]):  # every other: all valid
            regions = valid + [random_region(rng) for _ in range(n - len(valid))]
        rows = rr.rows_of(regions, LAYOUT)
        same = [Region(r.block_id, r.layer_start,
                       None if r.layers(LAYOUT)[1] == 4 else r.layer_end, r.num_blocks, r.rank,
                       r.head_start, None if r.heads(LAYOUT)[1] == 2 else r.head_end)
                for r in regions]  # open ends where they cover everything
        assert rr.to_regions(rows, LAYOUT) == same
        assert (rr.rows_from_wire(rr.pack_rows(rows)) == rows).all()
        errors = [e for e in (check_error(r, 2) for r in same) if e is not None]
        if errors:  # the first bad region's own error
            for check in (rr.check_rows, rr.checked_slices):
                with pytest.raises(ValueError) as raised:
                    check(rows, LAYOUT, BLOCKS, 2)
                assert str(raised.value) == errors[0]
            continue
        rr.check_rows(rows, LAYOUT, BLOCKS, 2)
        assert rr.checked_slices(rows, LAYOUT, BLOCKS, 2) == rr.by_slice(rows)
        assert rr.nbytes(rows, LAYOUT).tolist() == [r.nbytes(LAYOUT) for r in regions]
        whole = rr.whole_heads(rows, LAYOUT)
        assert whole.tolist() == [r.whole_heads(LAYOUT) for r in regions]
        assert [o for o, w in zip(rr.offsets(rows, LAYOUT).tolist(), whole, strict=True) if w] \
            == [r.resolve(LAYOUT, BLOCKS)[0] for r in regions if r.whole_heads(LAYOUT)]
        assert rr.block_ids(rows).tolist() == [
            b for r in regions for b in range(r.block_id, r.block_id + r.num_blocks)]
        # by_slice: the same (block, cell) pairs as region by region, cell by cell
        grouped = {(b, bit) for key, blocks in rr.by_slice(rows) for b in blocks
                   for bit in range(64) if rr.cell_mask(rr.slice_row(key), LAYOUT) >> bit & 1}
        assert grouped == set().union(*(cells(r, LAYOUT) for r in regions))
        # take_slices: those cells out of a grant of every cell, counted; none if two
        # rows cover one cell
        full = dict.fromkeys(range(BLOCKS), (1 << 64) - 1)
        grant = dict(full)
        taken = grants.take_slices(grant, rr.checked_slices(rows, LAYOUT, BLOCKS, 2), LAYOUT)
        if rr.cells_and_bytes(rows, LAYOUT)[0] > len(grouped):
            assert taken is None and grant == full
        else:
            assert taken == len(grouped)
            assert grouped == {(b, bit) for b in full for bit in range(64)
                               if (full[b] & ~grant.get(b, 0)) >> bit & 1}
        checked += 1
    assert checked >= 20  # the all-valid half at least


def test_rows_from_wire_refuses_what_is_not_packed_rows() -> None:
    rows = rr.rows_of([Region(3), Region(1, 1, 2)], LAYOUT)
    packed = rr.pack_rows(rows)
    assert rr.rows_from_wire(packed).tolist() == rows.tolist()
    received = bytearray(packed)  # as a receiver reads a payload: read in place
    assert np.shares_memory(rr.rows_from_wire(received), np.frombuffer(received, np.uint8))
    for bad in (rows.tolist(), None, 7, packed.decode("latin-1"), packed[:-12], packed + b"!"):
        with pytest.raises(ValueError):
            rr.rows_from_wire(bad)


def test_rows_near_int64_max_lie_outside_the_cache() -> None:
    """block + num_blocks would wrap around in int64: the bound holds without adding."""
    big = 2**63 - 1
    for row in ([big, 0, 4, 1, 0, 0, 2], [1, 0, 4, 2**62, 0, 0, 2]):
        for count in (1, rr.FEW, rr.FEW + 1):  # on plain ints, and with numpy
            rows = np.array([row] * count, dtype=np.int64)
            with pytest.raises(ValueError):
                rr.check_rows(rows, LAYOUT, BLOCKS, 1)


def run(coro_fn) -> None:  # type: ignore[no-untyped-def]
    asyncio.run(coro_fn())


def test_a_scattered_write_admitted_at_once_completes_as_region_by_region() -> None:
    """`admit_rows` + `landed_rows` of a chunk resolve the transfer exactly where
    `admit` + `landed` of each of its regions would, with its bytes."""
    async def main() -> None:
        blocks = random.Random(5).sample(range(BLOCKS), 40)
        regions = [Region(b) for b in blocks[:30]] + [Region(b, 1, 3) for b in blocks[30:]]
        one, batched = (TransferTable(LAYOUT, BLOCKS, TransferMetrics("receiver", n))
                        for n in ("one", "batched"))
        by_one = one.expect("x", regions, 1, 5)
        by_rows = batched.expect("x", rr.rows_of(regions, LAYOUT), 1, 5)
        first, second = rr.rows_of(regions[:25], LAYOUT), rr.rows_of(regions[25:], LAYOUT)
        for part in (regions[:25], regions[25:]):
            for r in part:
                assert one.admit("x", 1, r, writer=1)
                one.landed("x", r)
        assert batched.admit_rows("x", 1, first, writer=1)
        batched.check_integrity()
        assert not by_rows.done()
        batched.landed_rows("x", first)
        assert batched.admit_rows("x", 1, second, writer=1)
        batched.landed_rows("x", second)
        await by_one
        await by_rows
        for table in (one, batched):
            assert table.metrics.value("splitserve:kv_transfer_request_bytes_sum") == \
                30 * LAYOUT.block_bytes + 10 * 2 * LAYOUT.layer_bytes

    run(main)


@pytest.mark.parametrize("bad", ["claimed twice", "repeated in the write", "not expected",
                                 "outside the cache"])
def test_a_write_with_one_wrong_region_fails_the_transfer(bad: str) -> None:
    async def main() -> None:
        table = TransferTable(LAYOUT, BLOCKS, TransferMetrics("receiver", "t"))
        done = table.expect("x", [Region(b) for b in range(0, 40, 2)], 1, 5)
        if bad == "claimed twice":
            assert table.admit_rows("x", 1, rr.rows_of([Region(2)], LAYOUT), writer=1)
        write = [Region(b) for b in range(0, 20, 2)]
        write.append({"claimed twice": Region(2), "repeated in the write": Region(4),
                      "not expected": Region(3), "outside the cache": Region(BLOCKS)}[bad])
        rows = rr.rows_of(write, LAYOUT)
        assert not table.admit_rows("x", 1, rows, writer=1)
        if bad == "claimed twice":
            table.landed_rows("x", rr.rows_of([Region(2)], LAYOUT))
        with pytest.raises(ProtocolError):
            await done
        table.check_integrity()
        # stale from now on: dropped and counted, nothing claimed
        assert not table.admit_rows("x", 1, rows, writer=1)
        assert table.metrics.value("splitserve:kv_transfer_stale_writes_dropped_total") == 1

    run(main)


def test_expect_of_rows_refuses_overlaps_like_regions() -> None:
    async def main() -> None:
        table = TransferTable(LAYOUT, BLOCKS, TransferMetrics("receiver", "t"))
        table.expect("x", [Region(3, 0, 2), Region(3, 2, 4), Region(5)], 1, 5)
        for overlap in ([Region(5)], [Region(7), Region(7, 1, 2)], [Region(8), Region(8)]):
            with pytest.raises(ValueError, match="already expected"):
                table.expect("y", rr.rows_of(overlap, LAYOUT), 1, 5)
        table.check_integrity()
        assert np.array_equal(rr.rows_of([], LAYOUT), np.empty((0, 7), dtype=np.int64))

    run(main)


def test_a_malformed_written_fails_its_transfer_and_frees_its_blocks() -> None:
    """WRITTEN with a checksum count not matching its regions: the transfer fails, its
    grant is revoked, and once the connection is gone unanswered, the grant's bound
    (io_timeout_s + the copy budget + a margin past the last frame) frees its blocks for the next
    transfer, not before."""
    import socket

    import torch

    from kvtransfer.config import TransferConfig
    from kvtransfer.errors import KVTransferError, PeerUnavailable
    from kvtransfer.inplace import InPlaceReceiver
    from kvtransfer.receiver import Conn, ReceiverBase

    class Receiver(InPlaceReceiver):
        name = "shm"  # the in-place receiver's bookkeeping alone, no segment

    async def main() -> None:
        # a short copy budget: the bound is 0.5 + 0.2 + 0.5 s past the last frame
        r = Receiver(TransferConfig(transport="shm", token="x", lease_s=1.0,
                                    io_timeout_s=0.5, heartbeat_s=0.1, copy_budget_s=0.2))
        ReceiverBase.register(r, torch.zeros(LAYOUT.tensor_shape(16), dtype=torch.bfloat16),
                              LAYOUT)
        done = r.expect("x1", [Region(b) for b in range(4)], 1)
        a, b = socket.socketpair()
        conn = Conn(7, a, "peer")
        r._conns[7] = conn
        sent: list[bytes] = []

        async def send(c: Conn, data: bytes) -> None:
            sent.append(data)

        r._send = send  # type: ignore[method-assign]
        try:
            await r._on_reserve(conn, {"xfer": "x1", "gen": 1, "req": 5}, rr.pack_rows(
                rr.rows_of([Region(blk) for blk in range(4)], LAYOUT)))
            assert r.table._live["x1"].inflight == 1
            with pytest.raises(ProtocolError):
                await r._on_written(conn, {"req": 5, "checksums": [1, 2]},
                                    rr.pack_rows(rr.rows_of([Region(0)], LAYOUT)))
            await asyncio.sleep(0.05)  # the REVOKE goes out
            assert sent[-1][0] == 14 and json.loads(sent[-1][13:])["req"] == 5  # REVOKE
            r._drop_conn(conn, PeerUnavailable("gone"))
            await asyncio.sleep(0.5)
            assert not done.done(), "blocks freed before the grant's bound"
            with pytest.raises(KVTransferError):
                await asyncio.wait_for(done, 2.0 + r.config.copy_budget_s)
            assert "x1" not in r.table._live
            r.expect("x2", [Region(0)], 1)  # block 0 is free to expect again
        finally:
            a.close()
            b.close()
            await r.close()

    asyncio.run(main())


def test_a_reserve_groups_its_rows_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A RESERVE's rows are checked, claimed and granted on one grouping (their columns
    reduced once), and the grant holds exactly their cells."""
    import socket

    import torch

    from kvtransfer.config import TransferConfig
    from kvtransfer.inplace import InPlaceReceiver
    from kvtransfer.receiver import Conn, ReceiverBase

    class Receiver(InPlaceReceiver):
        name = "shm"  # the in-place receiver's bookkeeping alone, no segment

    async def main() -> None:
        r = Receiver(TransferConfig(transport="shm", token="x"))
        ReceiverBase.register(r, torch.zeros(LAYOUT.tensor_shape(BLOCKS), dtype=torch.bfloat16),
                              LAYOUT)
        dst = [Region(b) for b in range(0, 40, 2)] + [Region(b, 1, 3) for b in range(41, 50)]
        r.expect("x1", dst, 1)
        a, b = socket.socketpair()
        a.setblocking(False)
        conn = Conn(7, a, "peer")
        r._conns[7] = conn
        reduced: list[int] = []
        real = rr._column_bounds
        monkeypatch.setattr(rr, "_column_bounds", lambda rows: reduced.append(1) or real(rows))
        try:
            rows = rr.rows_of(dst, LAYOUT)
            await r._on_reserve(conn, {"xfer": "x1", "gen": 1, "req": 5}, rr.pack_rows(rows))
            assert reduced == [1]
            assert r._grants[(7, 5)].cells == grants.cells_of(rows, LAYOUT)
        finally:
            a.close()
            b.close()
            await r.close()

    asyncio.run(main())


def test_a_control_frame_naming_too_large_a_payload_ends_its_connection() -> None:
    """RESERVE and WRITTEN carry their rows as the frame's payload: one that claims more
    than `wire.MAX_META` bytes is a protocol error before any of it is read (the
    connection ends, failing what it wrote into), not a buffer of that size."""
    import socket

    import torch

    from kvtransfer import wire
    from kvtransfer.config import TransferConfig
    from kvtransfer.inplace import InPlaceReceiver
    from kvtransfer.receiver import Conn, ReceiverBase

    class Receiver(InPlaceReceiver):
        name = "shm"  # the in-place receiver's bookkeeping alone, no segment

    async def main() -> None:
        r = Receiver(TransferConfig(transport="shm", token="x"))
        ReceiverBase.register(r, torch.zeros(LAYOUT.tensor_shape(16), dtype=torch.bfloat16),
                              LAYOUT)
        r.expect("x1", [Region(0)], 1)  # what the RESERVE's rows would be granted
        a, b = socket.socketpair()
        a.setblocking(False)
        try:
            for kind in (wire.Frame.RESERVE, wire.Frame.WRITTEN):
                meta = json.dumps({"req": 5, "xfer": "x1", "gen": 1, "checksums": None})
                b.sendall(wire.pack_frame(kind, meta.encode(), wire.MAX_META + 1)
                          + rr.pack_rows(rr.rows_of([Region(0)], LAYOUT)))
                with pytest.raises(ProtocolError, match="too large"):
                    await asyncio.wait_for(r._frame_loop(Conn(7, a, "peer")), 5)
                a.recv(1 << 16)  # what followed the header was not read
            assert not r._grants and not r.table._live["x1"].claimed  # nothing granted
        finally:
            a.close()
            b.close()
            await r.close()

    asyncio.run(main())


def test_coalesce_rows_and_one_per_block_cover_the_same_cells() -> None:
    regions = [Region(b) for b in (3, 4, 5, 9, 10, 2)] + [Region(11, layer_start=1),
                                                         Region(12, layer_start=1)]
    rows = rr.rows_of(regions, LAYOUT)
    joined = rr.coalesce_rows(rows, LAYOUT)
    assert joined[:, rr.BLOCK].tolist() == [3, 9, 2, 11, 12]  # partial layers stay apart
    assert joined[:, rr.NUM_BLOCKS].tolist() == [3, 2, 1, 1, 1]
    split = rr.one_per_block(joined)
    assert np.array_equal(split, rows)
    assert grants.cells_of(joined, LAYOUT) == grants.cells_of(rows, LAYOUT)


def one_slice_rows(rng: random.Random, n: int, multi: bool) -> np.ndarray:
    """`n` valid rows (more than FEW) sharing one slice, random blocks and counts, each
    block id low enough for the largest count: rows whose column bounds alone prove
    them in the cache. `multi`: some rows of several blocks (whole layers)."""
    if multi:
        key = (0, 4, rng.randrange(2), 0, 2)
    else:
        start, first = rng.randrange(4), rng.randrange(2)
        key = (start, rng.randrange(start + 1, 5), rng.randrange(2), first,
               rng.randrange(first + 1, 3))
    most = 3 if multi else 1
    rows = [(rng.randrange(BLOCKS - most + 1), key[0], key[1], rng.randrange(1, most + 1),
             *key[2:]) for _ in range(n)]
    return np.array(rows, dtype=np.int64)


# one field of one row just past its limit, beside rows within it: (column, value)
NUDGES = [(rr.BLOCK, -1), (rr.RANK, -1), (rr.RANK, 2), (rr.HEAD_START, -1),
          (rr.HEAD_END, 3), (rr.LAYER_START, -1), (rr.LAYER_END, 5), (rr.NUM_BLOCKS, 0)]


def test_rows_of_one_slice_are_proven_by_their_bounds_and_one_past_a_limit_is_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The shortcut (`_bounds_hold`) is what decides one-slice rows: taken for every valid
    set, and never for a set with one row nudged past a single limit, whose error is
    the one `Region.check` gives for that row."""
    verdicts: list[bool] = []
    real = rr._bounds_hold

    def counted(*args):  # type: ignore[no-untyped-def]
        verdicts.append(real(*args))
        return verdicts[-1]

    monkeypatch.setattr(rr, "_bounds_hold", counted)
    rng = random.Random(11)
    for trial in range(120):
        rows = one_slice_rows(rng, rng.randrange(rr.FEW + 1, 60), multi=trial % 2 == 1)
        del verdicts[:]
        rr.check_rows(rows, LAYOUT, BLOCKS, 2)
        assert rr.checked_slices(rows, LAYOUT, BLOCKS, 2) == rr.by_slice(rows)
        assert verdicts[:2] == [True, True], "valid rows of one slice not proven by bounds"
        bad = rows.copy()
        i = rng.randrange(len(bad))
        if trial % 4 == 1:  # one multi-block row of layers 0..2 of 4 among single blocks
            bad[:, rr.NUM_BLOCKS], bad[:, rr.LAYER_END] = 1, 2
            bad[i, rr.NUM_BLOCKS] = 2
        elif trial % 4 == 3:  # block 62 of 3 blocks beside block 63 of 1, in 64
            bad[:, rr.NUM_BLOCKS] = 1
            bad[rng.randrange(len(bad)), rr.BLOCK] = BLOCKS - 1
            bad[i, rr.BLOCK], bad[i, rr.NUM_BLOCKS] = BLOCKS - 2, 3
        else:
            column, value = NUDGES[trial // 2 % len(NUDGES)]
            bad[i, column] = value
        want = check_error(rr.to_regions(bad[i:i + 1], LAYOUT)[0], 2)
        assert want is not None
        for check in (rr.check_rows, rr.checked_slices):
            with pytest.raises(ValueError) as raised:
                check(bad, LAYOUT, BLOCKS, 2)
            assert str(raised.value) == want


def test_rows_checked_one_by_one_are_reduced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Valid rows whose bounds prove nothing (whole-layer rows of several blocks beside
    partial-layer rows of one): `checked_slices` checks them row by row and groups them
    with the columns reduced once."""
    rows = rr.rows_of([Region(b, num_blocks=2) for b in range(0, 20, 2)]
                      + [Region(b, 1, 3) for b in range(30, 40)], LAYOUT)
    reduced: list[int] = []
    real = rr._column_bounds
    monkeypatch.setattr(rr, "_column_bounds", lambda r: reduced.append(len(r)) or real(r))
    slices = rr.checked_slices(rows, LAYOUT, BLOCKS, 1)
    assert reduced == [len(rows)]
    assert slices == rr.by_slice(rows)
    assert not rr._bounds_hold(real(rows), LAYOUT, BLOCKS, 1)
