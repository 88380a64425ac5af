"""tcp's WRITE frames over real sockets: a write's regions go as one frame per chunk
(bounded), land byte-exact with and without checksums, and a row table that fails its
checks lands nothing: the transfer and the connection end as for a single bad region."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import pytest
import torch

from kvtransfer import KVLayout, KVTransferError, PeerUnavailable, ProtocolError, Region, wire
from kvtransfer import region_rows as rr
from kvtransfer.tcp_frames import FRAME_ROWS, WriteHead
from tests.integration.kvtransfer_util import connected, fast_config, plan_lands, sender_child

pytestmark = pytest.mark.usefixtures("no_leaks")

# 64-byte blocks: a write of more than FRAME_ROWS scattered blocks stays small
TINY = KVLayout(num_layers=2, num_kv_heads=1, head_dim=2, block_size=2, dtype="float32")
POOL = 2 * FRAME_ROWS + 1000


def counting_writes(receiver: Any) -> list[int]:
    """The rows of every WRITE frame `receiver` handles, in order (the instance's
    handler wrapped; the frames are real)."""
    seen: list[int] = []
    handle = receiver._on_write

    async def counted(conn: Any, meta: bytes, payload_len: int) -> None:
        seen.append(len(WriteHead.unpack(meta).rows))
        await handle(conn, meta, payload_len)

    receiver._on_write = counted
    return seen


@pytest.mark.timeout(120)
def test_many_scattered_regions_land_byte_exact_in_bounded_frames() -> None:
    """Thousands of scattered blocks per write (a few adjacent, some descending), with
    and without checksums, from another process: one frame per FRAME_ROWS regions."""
    rng = random.Random(11)
    sizes = (FRAME_ROWS + 300, 600)  # (the spec travels on the peer's command line)
    dst = rng.sample(range(POOL), sum(sizes))
    plan = []
    for i, (n, checksum) in enumerate(zip(sizes, (True, False), strict=True)):
        mine = dst[i * sizes[0]:i * sizes[0] + n]
        mine[10:20] = sorted(mine[10:20])  # runs that may meet in the cache
        mine[20:30] = sorted(mine[20:30], reverse=True)
        plan.append({"xfer": f"many-{i}", "gen": 1, "src": [[[s] for s in range(n)]],
                     "dst": [[[d] for d in mine]], "checksum": checksum})
    n = sizes[0]

    async def main() -> None:
        async with sender_child(fast_config("tcp"), TINY, POOL, n, plan) as (receiver, peer):
            frames = counting_writes(receiver)
            futures = [receiver.expect(t["xfer"], [Region(*d) for d in t["dst"][0]], 1)
                       for t in plan]
            await plan_lands(receiver, peer, plan, futures, n)
            assert sorted(frames) == [300, 600, FRAME_ROWS]

    asyncio.run(main())


LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
BLOCK = LAYOUT.block_bytes


async def send_frame(peer: Any, xfer: str, gen: int, regions: list[Region],
                     payload_len: int | None = None) -> None:
    """A WRITE frame as a sender puts it on the wire, its table as given, its payload
    0x5A bytes (`payload_len`: what the frame header says follows)."""
    table = rr.rows_of(regions, LAYOUT)
    size = int(rr.nbytes(table, LAYOUT).sum()) if payload_len is None else payload_len
    meta = WriteHead(xfer, gen, table).pack()
    async with peer.send_lock:
        await wire.send_all(asyncio.get_running_loop(), peer.sock,
                            wire.pack_frame(wire.Frame.WRITE, meta, size) + b"\x5a" * size)


BAD_TABLES = {  # the transfer expects blocks 2, 3, 5 under generation 2
    "out of bounds": ([Region(2), Region(16)], "16"),
    "duplicate cell": ([Region(2), Region(3), Region(2)], "not expected"),
    "overlapping rows": ([Region(2, num_blocks=2), Region(3, 1, 2)], "not expected"),
    "unexpected block": ([Region(2), Region(4)], "not expected"),
    "no rows": ([], "without regions"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(BAD_TABLES))
def test_a_bad_row_table_fails_the_transfer_and_lands_nothing(case: str) -> None:
    """Fails the transfer (ProtocolError), discards the payload: not a byte lands, even of
    the table's good rows; the connection goes on, and its next transfer lands."""
    regions, message = BAD_TABLES[case]

    async def main() -> None:
        async with connected(fast_config("tcp"), LAYOUT, 16, 16,
                             seed=5) as (receiver, sender, peer):
            bad = receiver.expect("bad", [Region(2), Region(3), Region(5)], 2)
            await send_frame(peer, "bad", 2, regions)
            with pytest.raises(ProtocolError, match=message):
                await asyncio.wait_for(bad, 5)
            assert not receiver.kv.tensor.any(), "a byte of a refused table landed"
            good = receiver.expect("good", [Region(7), Region(9)], 1)
            await sender.write(peer, [Region(0), Region(1)], [Region(7), Region(9)], "good", 1,
                               checksum=True)
            await sender.finish(peer, "good")
            await asyncio.wait_for(good, 5)
            assert torch.equal(receiver.kv.tensor[[7, 9]], sender.kv.tensor[[0, 1]])
            assert not receiver.kv.tensor[[2, 3, 5]].any()
            receiver.table.check_integrity()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_stale_generation_is_dropped_and_the_transfer_goes_on() -> None:
    async def main() -> None:
        async with connected(fast_config("tcp"), LAYOUT, 16, 16,
                             seed=5) as (receiver, sender, peer):
            live = receiver.expect("x", [Region(2), Region(3)], 2)
            await send_frame(peer, "x", 1, [Region(2), Region(3)])  # an older generation
            await send_frame(peer, "y", 1, [Region(2)])  # a transfer nobody expects
            await sender.write(peer, [Region(4), Region(6)], [Region(2), Region(3)], "x", 2)
            await sender.finish(peer, "x")
            await asyncio.wait_for(live, 5)
            m = receiver.metrics
            assert m.value("splitserve:kv_transfer_stale_writes_dropped_total") == 2
            assert torch.equal(receiver.kv.tensor[[2, 3]], sender.kv.tensor[[4, 6]])

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delta", [-BLOCK, 1, BLOCK])
def test_a_payload_that_is_not_the_rows_total_ends_the_connection(delta: int) -> None:
    """The frame's framing disagrees with its own table: nothing lands, the transfer
    fails (ProtocolError), the connection is closed (its stream cannot be trusted)."""
    async def main() -> None:
        async with connected(fast_config("tcp"), LAYOUT, 16, 16,
                             seed=5) as (receiver, sender, peer):
            xfer = receiver.expect("x", [Region(2), Region(3)], 1)
            await send_frame(peer, "x", 1, [Region(2), Region(3)], 2 * BLOCK + delta)
            with pytest.raises(ProtocolError, match="payload of"):
                await asyncio.wait_for(xfer, 5)
            assert not receiver.kv.tensor.any()
            with pytest.raises(PeerUnavailable):
                for _ in range(50):  # the receiver closed it: the sender finds out
                    await sender.write(peer, [Region(0)], [Region(5)], "z", 1)
                    await asyncio.sleep(0.05)
            assert not receiver.kv.tensor.any()

    asyncio.run(main())


# 256 KiB blocks: a write of 64 scattered blocks is a 16 MiB frame, sent over many awaits
BIG = KVLayout(num_layers=2, num_kv_heads=2, head_dim=128, block_size=64, dtype="float32")


@pytest.mark.timeout(60)
def test_a_write_cancelled_mid_frame_leaves_the_connection_usable() -> None:
    """A Prefill's deadline or a client gone cancels its write while a frame is on the
    wire: the frame still goes whole, so the next transfer on the same connection lands
    (a half-sent frame would make the receiver read its frames as payload)."""
    async def main() -> None:
        async with connected(fast_config("tcp"), BIG, 132, 132, seed=5) as (receiver, sender, peer):
            dst = [Region(2 * i) for i in range(64)]
            gone = receiver.expect("gone", dst, 1)
            write = asyncio.create_task(
                sender.write(peer, [Region(i) for i in range(64)], dst, "gone", 1))
            while not peer.send_lock.locked():
                await asyncio.sleep(0)
            write.cancel()  # the frame has begun: its header is out, its payload is not
            with pytest.raises(asyncio.CancelledError):
                await write
            await sender.cancel(peer, "gone")
            # the frame went whole: its blocks landed before the CANCEL, or it fenced them
            with contextlib.suppress(KVTransferError):
                await asyncio.wait_for(gone, 10)
            nxt = receiver.expect("next", [Region(129), Region(131)], 1)
            await sender.write(peer, [Region(7), Region(9)], [Region(129), Region(131)],
                               "next", 1, checksum=True)
            await sender.finish(peer, "next")
            await asyncio.wait_for(nxt, 10)
            assert torch.equal(receiver.kv.tensor[[129, 131]], sender.kv.tensor[[7, 9]])
            assert peer.alive
            receiver.table.check_integrity()

    asyncio.run(main())
