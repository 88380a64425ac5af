"""Faults across two processes: killed and hung peers, corruption, late writes.

Every case ends in a typed error within its deadline; nothing hangs or leaks.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import time
from typing import Any

import pytest
import torch

from kvtransfer import (
    IntegrityError,
    PeerUnavailable,
    Region,
    TransferCancelled,
    TransferTimeout,
)
from tests.integration.kvtransfer_util import (
    LAYOUT_F32,
    PeerProcess,
    fast_config,
    spec,
    start_receiver,
    start_sender,
)
from tests.integration.test_kvtransfer_transports import TRANSPORTS, no_leaks  # noqa: F401

TWO_WRITES = [{"xfer": "r1", "gen": 1, "src": [[[0]], [[1]]], "dst": [[[5]], [[9]]],
               "checksum": True}]


async def _with_sender_child(transport: str, plan: list[dict[str, Any]], body: Any,
                             lease_s: float = 10.0, **extra: Any) -> None:
    config = fast_config(transport, lease_s=lease_s)
    receiver = await start_receiver(config, LAYOUT_F32, 16)
    peer = PeerProcess(spec("sender", config, LAYOUT_F32, 4, plan,
                            address=receiver.address(), **extra))
    try:
        await body(receiver, peer)
    finally:
        await peer.aclose()
        await receiver.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sender_killed_mid_transfer(transport: str, no_leaks: None) -> None:  # noqa: F811
    async def body(receiver: Any, peer: PeerProcess) -> None:
        future = receiver.expect("r1", [Region(5), Region(9)], 1)
        await peer.start()
        assert (await peer.line())["ready"]
        assert (await peer.line())["stopping"]  # first region written, then SIGSTOP
        peer.kill()
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable):
            await asyncio.wait_for(future, 8)
        assert time.monotonic() - t0 < 8
        assert not receiver.kv.tensor[9].any()

    asyncio.run(_with_sender_child(transport, TWO_WRITES, body, stop_after_first_write=True))


@pytest.mark.timeout(60)
def test_hung_sender_hits_the_lease(no_leaks: None) -> None:  # noqa: F811
    async def body(receiver: Any, peer: PeerProcess) -> None:
        future = receiver.expect("r1", [Region(5), Region(9)], 1, lease_s=1.0)
        await peer.start()
        assert (await peer.line())["ready"]
        assert (await peer.line())["stopping"]
        with pytest.raises((TransferTimeout, PeerUnavailable)):
            await asyncio.wait_for(future, 8)
        m = receiver.metrics
        assert m.value("splitserve:kv_transfer_failures_total", kind="timeout") + \
            m.value("splitserve:kv_transfer_failures_total", kind="peer") == 1

    asyncio.run(_with_sender_child("tcp", TWO_WRITES, body, stop_after_first_write=True))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_receiver_killed_or_hung(transport: str, fault: str, no_leaks: None) -> None:  # noqa: F811
    if (transport, fault) == ("ucx", "hung"):
        # The sender gets its typed error in time and survives, but UCX keeps its TCP
        # connection to the stopped peer after close (a send is still in flight in
        # UCX), which the no_leaks check counts. See kvtransfer/ucx.py.
        pytest.skip("ucx keeps a socket to a SIGSTOPped receiver after close")

    async def main() -> None:
        config = fast_config(transport)
        plan = [{"xfer": "r1", "gen": 1, "dst": [[0], [1], [2], [3]]}]
        peer = await PeerProcess(spec("receiver", config, LAYOUT_F32, 8, plan)).start()
        sender = start_sender(config, LAYOUT_F32, 8, seed=3)
        try:
            conn = await sender.connect((await peer.line())["address"])
            await sender.write(conn, [Region(0)], [Region(0)], "r1", 1)
            os.kill(peer.proc.pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises((PeerUnavailable, TransferTimeout)):
                await sender.write(conn, [Region(1)], [Region(1)], "r1", 1)
                await sender.finish(conn, "r1", timeout_s=4.0)
            assert time.monotonic() - t0 < 6
        finally:
            await sender.close()
            await peer.aclose()
            if transport == "shm":  # a SIGKILLed receiver cannot unlink its segment
                from kvtransfer.shm import reap_orphaned_segments
                assert reap_orphaned_segments()

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_corrupted_payload_fails_checksum(transport: str, no_leaks: None) -> None:  # noqa: F811
    async def body(receiver: Any, peer: PeerProcess) -> None:
        future = receiver.expect("r1", [Region(5), Region(9)], 1)
        await peer.start()
        assert (await peer.line())["ready"]
        verdict = await peer.line()
        assert (verdict["ok"], verdict["kind"]) == (False, "integrity")
        with pytest.raises(IntegrityError):
            await asyncio.wait_for(future, 5)

    asyncio.run(_with_sender_child(transport, TWO_WRITES, body, corrupt=True))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_late_write_after_abort_is_dropped(transport: str, no_leaks: None) -> None:  # noqa: F811
    async def body(receiver: Any, peer: PeerProcess) -> None:
        future = receiver.expect("r1", [Region(5), Region(9)], 1)
        assert receiver.cancel("r1", "request aborted")
        with pytest.raises(TransferCancelled):
            await future
        # The blocks are reused at once by another transfer under a new generation.
        reused = receiver.expect("r1", [Region(5), Region(9)], 2, lease_s=3.0)
        await peer.start()
        assert (await peer.line())["ready"]
        verdict = await peer.line()
        assert (verdict["ok"], verdict["kind"]) == (False, "cancelled")
        assert receiver.metrics.value("splitserve:kv_transfer_stale_writes_dropped_total") >= 1
        assert not receiver.kv.tensor.any(), "a stale write landed"
        assert not reused.done()
        receiver.cancel("r1")

    asyncio.run(_with_sender_child(transport, TWO_WRITES, body))


@pytest.mark.timeout(60)
@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx not installed")
def test_ucx_sender_gone_before_its_payload(no_leaks: None) -> None:  # noqa: F811
    """A WRITE announced but its UCX message never sent: the receive posted into the
    blocks must not keep them (or the transfer) forever once the sender is gone."""
    from kvtransfer import wire
    from kvtransfer.ucx import UcxSender

    class AnnounceOnly(UcxSender):  # a sender that dies between frame and payload
        async def _send_regions(self, peer: Any, pairs: Any, xfer_id: str, generation: int,
                                checksum: bool) -> None:
            for _, dst in pairs:
                async with peer.send_lock:
                    peer.state["seq"] += 1
                    await wire.send_all(asyncio.get_running_loop(), peer.sock, wire.pack_frame(
                        wire.Frame.WRITE, wire.WriteHeader(xfer_id, generation, dst, 0, 0).pack()))

    async def main() -> None:
        config = fast_config("ucx")
        receiver = await start_receiver(config, LAYOUT_F32, 16)
        sender = AnnounceOnly(config)
        sender.register(start_sender(config, LAYOUT_F32, 16, seed=3).kv.tensor, LAYOUT_F32)
        good = start_sender(config, LAYOUT_F32, 16, seed=4)
        try:
            future = receiver.expect("r1", [Region(5), Region(9)], 1)
            conn = await sender.connect(receiver.address())
            await sender.write(conn, [Region(0)], [Region(5)], "r1", 1)
            await asyncio.sleep(0.3)
            assert receiver.table.pending() == ["r1"]
            await sender.disconnect(conn)
            t0 = time.monotonic()
            with pytest.raises(PeerUnavailable):
                await asyncio.wait_for(future, 5)
            assert time.monotonic() - t0 < 3 and not receiver.table.pending()
            await asyncio.sleep(0.1)
            assert not receiver._posted, "receives of a gone sender were kept"
            # The blocks are free for a new transfer, and only its bytes land in them.
            again = receiver.expect("r2", [Region(5), Region(9)], 1)
            peer = await good.connect(receiver.address())
            await good.write(peer, [Region(0), Region(1)], [Region(5), Region(9)], "r2", 1)
            await good.finish(peer, "r2")
            await asyncio.wait_for(again, 5)
            assert torch.equal(receiver.kv.tensor[5], good.kv.tensor[0])
            assert torch.equal(receiver.kv.tensor[9], good.kv.tensor[1])
        finally:
            await sender.close()
            await good.close()
            await receiver.close()

    asyncio.run(main())
