"""How an in-place transfer's grant is asked for (`kvtransfer/inplace_sender.py`): a
destination too large for one frame goes in several RESERVEs of one grant, writes into
cells no begin announced extend the grant, and a grant asked for twice is refused
without breaking the connection."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from kvtransfer import KVLayout, KVTransferError, ProtocolError, Region, TransferCancelled
from kvtransfer.wire import MAX_META
from tests.integration.kvtransfer_util import (
    IN_PLACE,
    LAYOUT_F32,
    connected,
    fast_config,
    until,
)

pytestmark = pytest.mark.usefixtures("no_leaks")

TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=1, dtype="float32")


@pytest.mark.timeout(120)
def test_a_destination_larger_than_a_frame_is_granted_in_parts() -> None:
    """Every other block of 40,000: 20,000 rows that no coalescing joins, ~1.1 MB of
    packed rows (over `MAX_META` for one RESERVE); a second transfer on the same
    connection completes too."""
    blocks = 40_000
    dst = [Region(b) for b in range(0, blocks, 2)]
    assert len(dst) * 56 > MAX_META

    async def main() -> None:
        async with connected(fast_config("shm"), TINY, blocks, 64,
                             seed=5) as (receiver, sender, peer):
            landed = receiver.expect("big", dst, 1)
            await sender.begin(peer, dst, "big", 1)
            for i in range(0, len(dst), 4096):
                part = dst[i:i + 4096]
                await sender.write(peer, [Region(j % 64) for j in range(i, i + len(part))],
                                   part, "big", 1)
            await sender.finish(peer, "big", 1)
            await asyncio.wait_for(landed, 10)
            src, got = sender.kv.tensor, receiver.kv.tensor
            for k in (0, 1, 777, len(dst) - 1):
                assert torch.equal(got[dst[k].block_id], src[k % 64])
            again = receiver.expect("small", [Region(1)], 1)  # the connection is intact
            await sender.write(peer, [Region(0)], [Region(1)], "small", 1)
            await sender.finish(peer, "small", 1)
            await asyncio.wait_for(again, 5)

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_write_larger_than_a_frame_is_noticed_in_parts() -> None:
    """One write of 20,000 scattered blocks, checksummed: its rows (~1.1 MB packed,
    over `MAX_META`) and checksums go in several WRITTEN frames of one notice, and the
    transfer completes with every block in place."""
    blocks = 40_000
    dst = [Region(b) for b in range(1, blocks, 2)]
    assert len(dst) * 56 > MAX_META

    async def main() -> None:
        async with connected(fast_config("shm", checksum=True), TINY, blocks, 64,
                             seed=6) as (receiver, sender, peer):
            landed = receiver.expect("big", dst, 1)
            await sender.begin(peer, dst, "big", 1)
            await sender.write(peer, [Region(j % 64) for j in range(len(dst))], dst, "big", 1)
            await sender.finish(peer, "big", 1)
            await asyncio.wait_for(landed, 10)
            src, got = sender.kv.tensor, receiver.kv.tensor
            for k in (0, 8191, 8192, len(dst) - 1):
                assert torch.equal(got[dst[k].block_id], src[k % 64])

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", IN_PLACE)
def test_writes_outside_the_begun_cells_extend_the_grant(transport: str) -> None:
    async def main() -> None:
        async with connected(fast_config(transport), LAYOUT_F32, 16, 8,
                             seed=7) as (receiver, sender, peer):
            # no begin at all: each write asks for its own cells
            landed = receiver.expect("a", [Region(3), Region(9), Region(4)], 1)
            await sender.write(peer, [Region(0)], [Region(3)], "a", 1)
            await sender.write(peer, [Region(1), Region(2)], [Region(9), Region(4)], "a", 1)
            await sender.finish(peer, "a", 1)
            await asyncio.wait_for(landed, 5)
            # a begin of part of the destination, then a write beyond it
            landed = receiver.expect("b", [Region(5), Region(6)], 1)
            await sender.begin(peer, [Region(5)], "b", 1)
            await sender.write(peer, [Region(3), Region(4)], [Region(5), Region(6)], "b", 1)
            await sender.finish(peer, "b", 1)
            await asyncio.wait_for(landed, 5)
            src, got = sender.kv.tensor, receiver.kv.tensor
            for s, d in ((0, 3), (1, 9), (2, 4), (3, 5), (4, 6)):
                assert torch.equal(got[d], src[s])
            # a cell written before is refused (typed), the transfer fails, the
            # connection stays
            landed = receiver.expect("c", [Region(7), Region(8)], 1)
            await sender.write(peer, [Region(0)], [Region(7)], "c", 1)
            with pytest.raises(ProtocolError):
                await sender.write(peer, [Region(1)], [Region(7)], "c", 1)
            with pytest.raises(ProtocolError):
                await asyncio.wait_for(landed, 10)
            assert peer.alive
            # overlapping destinations: refused here (typed), the transfer fenced there
            landed = receiver.expect("d", [Region(10), Region(11)], 1, lease_s=60.0)
            with pytest.raises(ProtocolError):
                await sender.write(peer, [Region(0), Region(1)], [Region(10), Region(10)],
                                   "d", 1)
            with pytest.raises(TransferCancelled):
                await asyncio.wait_for(landed, 5)
            assert peer.alive

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_second_grant_of_a_transfer_is_refused_not_dropped() -> None:
    """A begin retried after its timeout asks again under a new request: the receiver
    cannot tell the two grants' writes apart, so it fails the transfer and refuses the
    second (typed), keeping the connection."""
    async def main() -> None:
        async with connected(fast_config("shm"), LAYOUT_F32, 16, 8,
                             seed=9) as (receiver, sender, peer):
            landed = receiver.expect("x", [Region(2), Region(3)], 1)
            await sender.begin(peer, [Region(2), Region(3)], "x", 1)
            peer.grants.clear()  # as a begin that timed out after the RESERVE went out
            with pytest.raises(ProtocolError):
                await sender.begin(peer, [Region(2), Region(3)], "x", 1)
            with pytest.raises(ProtocolError):
                await asyncio.wait_for(landed, 10)
            assert peer.alive
            again = receiver.expect("y", [Region(5)], 1)
            await sender.write(peer, [Region(0)], [Region(5)], "y", 1)
            await sender.finish(peer, "y", 1)
            await asyncio.wait_for(again, 5)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_revoke_not_sent_in_time_drops_the_connection() -> None:
    """The REVOKE cannot go out (the connection's send lock held past io_timeout_s): the
    receiver drops the connection, so no PING extends the sender's window, and lets the
    cells go within the grant's bound after that."""
    async def main() -> None:
        config = fast_config("shm", io_timeout_s=0.5, copy_budget_s=0.5)
        async with connected(config, LAYOUT_F32, 16, 8, seed=11) as (receiver, sender, peer):
            landed = receiver.expect("x", [Region(2), Region(3)], 1, lease_s=60.0)
            await sender.begin(peer, [Region(2), Region(3)], "x", 1)
            (conn,) = receiver._conns.values()
            async with conn.send_lock:  # as a frame stuck on a full socket
                t0 = asyncio.get_running_loop().time()
                receiver.cancel("x", "client cancelled")
                with contextlib.suppress(TimeoutError):
                    await until(lambda: not receiver._conns, config.io_timeout_s + 0.3)
                assert not receiver._conns, "the connection outlived its REVOKE"
            with pytest.raises(KVTransferError):
                await asyncio.wait_for(landed, 2 * config.io_timeout_s + config.copy_budget_s + 1)
            assert asyncio.get_running_loop().time() - t0 < \
                2 * config.io_timeout_s + config.copy_budget_s + 1
            with contextlib.suppress(TimeoutError):
                await until(lambda: not peer.alive, 0.2)
            assert not peer.alive

    asyncio.run(main())
