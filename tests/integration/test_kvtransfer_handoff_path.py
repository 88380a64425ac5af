"""What a small hand-off does on its way, per transport: the frames and hops it takes
(`bench transfer --handoffs` measures what they cost). A verdict goes out from the
frame loop that resolved it; a tcp writer sends no FINISH and is answered even when its
write is dropped; shm copies through views made once per connection; cuda_ipc's host
mover copies a small chunk on the sender's loop and a large one on its copy thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from typing import Any

import pytest
import torch

from kvtransfer import PeerUnavailable, Region, TransferCancelled, wire
from kvtransfer.cuda_ipc import INLINE_COPY_BYTES, HostMover
from kvtransfer.memory import FutureReady
from tests.integration.kvtransfer_util import (
    LAYOUT_BF16,
    connected,
    fast_config,
)

pytestmark = pytest.mark.usefixtures("no_leaks")

SRC, DST = [1, 2, 3], [9, 4, 12]


def _spied(receiver: Any) -> tuple[list[str], list[int]]:
    """Records the coroutines the receiver spawns and counts the FINISH frames it takes."""
    spawned: list[str] = []
    finishes = [0]
    spawn, on_finish = receiver._spawn, receiver._on_finish

    def spy_spawn(coro: Any) -> Any:
        spawned.append(coro.__qualname__)
        return spawn(coro)

    async def spy_finish(conn: Any, msg: dict[str, Any]) -> None:
        finishes[0] += 1
        await on_finish(conn, msg)

    receiver._spawn, receiver._on_finish = spy_spawn, spy_finish
    return spawned, finishes


@pytest.mark.parametrize("transport", ["tcp", "shm", "cuda_ipc"])
def test_a_hand_off_is_answered_by_the_frame_that_ends_it(transport: str) -> None:
    """The verdict goes out from the receiving frame loop (no task spawned for it); no
    FINISH crosses the wire (tcp: its WRITE frames are answered; in-place: the grant
    makes the sender a writer); the blocks land bit-exact."""

    async def main() -> None:
        async with connected(fast_config(transport), LAYOUT_BF16, 16, 8,
                             seed=4) as (receiver, sender, peer):
            spawned, finishes = _spied(receiver)
            for i in range(3):
                landed = receiver.expect(f"x{i}", [Region(d) for d in DST], 1)
                await sender.begin(peer, [Region(d) for d in DST], f"x{i}", 1)
                await sender.write(peer, [Region(s) for s in SRC], [Region(d) for d in DST],
                                   f"x{i}", 1)
                await sender.finish(peer, f"x{i}", 1, timeout_s=5)
                await asyncio.wait_for(landed, 5)
            assert finishes == [0]
            assert "ReceiverBase._send_quietly" not in spawned
            got = receiver.kv.tensor[DST].view(torch.uint8)
            assert torch.equal(got, sender.kv.tensor[SRC].view(torch.uint8))

    asyncio.run(main())


def test_a_tcp_write_into_a_fenced_transfer_is_answered_without_finish() -> None:
    """A WRITE frame the receiver drops (its transfer cancelled there) is answered with
    the verdict, as a FINISH would be: the sender's finish raises TransferCancelled
    rather than waiting out its deadline."""

    async def main() -> None:
        async with connected(fast_config("tcp"), LAYOUT_BF16, 16, 8,
                             seed=4) as (receiver, sender, peer):
            _, finishes = _spied(receiver)
            failed = receiver.expect("gone", [Region(d) for d in DST], 1)
            assert receiver.cancel("gone", "client went away")
            with pytest.raises(TransferCancelled):
                await failed
            await sender.write(peer, [Region(s) for s in SRC], [Region(d) for d in DST],
                               "gone", 1)
            with pytest.raises(TransferCancelled):
                await sender.finish(peer, "gone", 1, timeout_s=30)
            assert finishes == [1]  # the dropped WRITE, answered as a FINISH
            assert not receiver.kv.tensor[DST].view(torch.uint8).any()
            landed = receiver.expect("next", [Region(0)], 1)  # the connection is intact
            await sender.write(peer, [Region(0)], [Region(0)], "next", 1)
            await sender.finish(peer, "next", 1, timeout_s=5)
            await asyncio.wait_for(landed, 5)

    asyncio.run(main())


def test_shm_writes_copy_through_views_made_once_and_let_go_at_disconnect(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes of a few regions and of many make no byte view of the mapped segment;
    disconnect lets the views go (releasing them) before it closes the mappings, and a
    copy whose source became ready after the disconnect raises PeerUnavailable instead
    of writing through an unmapped segment."""
    import kvtransfer.shm as shm

    async def main() -> None:
        async with connected(fast_config("shm"), LAYOUT_BF16, 64, 32,
                             seed=6) as (receiver, sender, peer):
            maps = peer.state[0]
            made = [0]
            host_bytes = shm.host_bytes

            def counted(t: torch.Tensor) -> memoryview:
                made[0] += 1
                return host_bytes(t)

            monkeypatch.setattr(shm, "host_bytes", counted)
            for name, src, dst in (("few", SRC, DST),
                                   ("many", list(range(20)), list(range(63, 23, -2)))):
                landed = receiver.expect(name, [Region(d) for d in dst], 1)
                await sender.begin(peer, [Region(d) for d in dst], name, 1)
                await sender.write(peer, [Region(s) for s in src], [Region(d) for d in dst],
                                   name, 1)
                await sender.finish(peer, name, 1, timeout_s=5)
                await asyncio.wait_for(landed, 5)
                got = receiver.kv.tensor[dst].view(torch.uint8)
                assert torch.equal(got, sender.kv.tensor[src].view(torch.uint8))
            assert made == [0]
            views = peer.state[3]
            source = concurrent.futures.Future[None]()
            pending = asyncio.create_task(sender._copy(
                peer, [(Region(0), Region(0))], time.monotonic() + 30, FutureReady(source)))
            await asyncio.sleep(0)  # the copy waits for its source
            await sender.disconnect(peer)
            source.set_result(None)
            with pytest.raises(PeerUnavailable):
                await asyncio.wait_for(pending, 5)
            assert peer.state is None and all(m.closed for m in maps)
            with pytest.raises(ValueError):  # released: a write raises, it cannot fault
                views[0][0:1] = b"x"

    asyncio.run(main())


def test_host_mover_copies_a_small_chunk_inline_and_a_large_or_queued_one_on_its_thread() -> None:
    """A chunk of at most `inline_bytes` with no copy queued lands before `copy` returns
    (None: nothing to wait for); a larger one, or one behind a queued copy, goes to the
    copy thread, in order (a FutureReady)."""
    from kvtransfer.memory import RegisteredKV

    layout = LAYOUT_BF16
    src = RegisteredKV(torch.arange(16 * layout.block_bytes // 2, dtype=torch.int16)
                       .view(torch.bfloat16).view(layout.tensor_shape(16)), layout)
    dst = RegisteredKV(torch.zeros(layout.tensor_shape(16), dtype=torch.bfloat16), layout)
    assert HostMover().inline_bytes == INLINE_COPY_BYTES
    mover = HostMover(inline_bytes=2 * layout.block_bytes)
    there = mover.open(mover.export(dst), src)
    far = 1e18  # the grant's start bound: not reached

    def landed(pairs: list[tuple[int, int]]) -> bool:
        return all(torch.equal(dst.tensor[d], src.tensor[s]) for s, d in pairs)

    gate = threading.Event()

    async def main() -> None:
        small = await mover.copy(src, there, [(Region(1, num_blocks=2), Region(5, num_blocks=2))],
                                 far, None)
        assert small is None and landed([(1, 5), (2, 6)])
        large = await mover.copy(src, there, [(Region(3, num_blocks=3), Region(8, num_blocks=3))],
                                 far, None)
        assert isinstance(large, FutureReady)
        large.synchronize()
        assert landed([(3, 8), (4, 9), (5, 10)])
        blocker = mover._pool.submit(gate.wait, 10)
        mover._last = blocker  # a copy queued on the thread, not done
        queued = await mover.copy(src, there, [(Region(0), Region(0))], far, None)
        assert isinstance(queued, FutureReady) and not landed([(0, 0)])
        gate.set()
        queued.synchronize()
        assert landed([(0, 0)])

    try:
        asyncio.run(main())
    finally:
        gate.set()  # a failed check leaves no copy thread waiting on it
        mover.close([])


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_transfer_cancelled_while_its_frame_is_on_the_way_leaves_no_entry(transport: str) -> None:
    """A cancel that lands while a WRITE waits for its source (tcp) or a begin waits for
    its GRANT (shm) ends the transfer: the frame's answer re-creates no entry for it."""

    async def main() -> None:
        async with connected(fast_config(transport), LAYOUT_BF16, 16, 8,
                             seed=7) as (receiver, sender, peer):
            dst = [Region(d) for d in DST]
            landed = receiver.expect("gone", dst, 1)
            if transport == "tcp":
                source = concurrent.futures.Future[None]()
                pending = asyncio.create_task(sender.write(
                    peer, [Region(s) for s in SRC], dst, "gone", 1, ready=FutureReady(source)))
            else:
                pending = asyncio.create_task(sender.begin(peer, dst, "gone", 1))
            async with wire.deadline(5):  # the write waits for its source, the begin for
                await asyncio.sleep(0)    # a GRANT
                while transport == "shm" and not peer.replies:
                    await asyncio.sleep(0.001)
            assert "gone" in peer.outgoing
            await sender.cancel(peer, "gone", 1)
            if transport == "tcp":
                source.set_result(None)
            with contextlib.suppress(TransferCancelled):
                await asyncio.wait_for(pending, 5)
            with contextlib.suppress(TransferCancelled):
                await asyncio.wait_for(landed, 5)  # the receiver fenced it
            assert "gone" not in peer.outgoing

    asyncio.run(main())


@pytest.mark.parametrize("inline", [True, False])
def test_a_host_copy_that_faults_fails_the_peer_inline_or_on_its_thread(inline: bool) -> None:
    """process_vm_writev into memory the receiver no longer has (here: an address
    nothing maps) fails the peer, whether the copy ran on the sender's loop (a small
    chunk) or on the mover's thread."""

    async def main() -> None:
        async with connected(fast_config("cuda_ipc", inline_copy_bytes=INLINE_COPY_BYTES if inline else 0), LAYOUT_BF16, 16, 8,
                             seed=8) as (receiver, sender, peer):
            pid, _, blocks = peer.state
            peer.state = (pid, 4096, blocks)  # the zero page's neighbour: never mapped
            dst = [Region(d) for d in DST]
            landed = receiver.expect("fault", dst, 1)
            await sender.begin(peer, dst, "fault", 1)
            with contextlib.suppress(PeerUnavailable):  # inline: raised by the write
                await sender.write(peer, [Region(s) for s in SRC], dst, "fault", 1)
            with pytest.raises(PeerUnavailable):
                await sender.finish(peer, "fault", 1, timeout_s=5)
            assert isinstance(peer.error, PeerUnavailable)
            assert "process_vm_writev" in str(peer.error)
            landed.cancel()

    asyncio.run(main())
