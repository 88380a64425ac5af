"""Faults: killed and hung peers and corruption (across two processes), late writes.

Every case ends in a typed error within its deadline; nothing hangs or leaks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from typing import Any

import pytest

from kvtransfer import (
    IntegrityError,
    PeerUnavailable,
    Region,
    TransferCancelled,
    TransferTimeout,
)
from tests.integration.kvtransfer_util import (
    LAYOUT_F32,
    NO_UCX,
    TRANSPORTS,
    PeerProcess,
    connected,
    fast_config,
    sender_child,
    spec,
    start_receiver,
    start_sender,
)

pytestmark = pytest.mark.usefixtures("no_leaks")

TWO_WRITES = [{"xfer": "r1", "gen": 1, "src": [[[0]], [[1]]], "dst": [[[5]], [[9]]],
               "checksum": True}]


async def _with_sender_child(transport: str, plan: list[dict[str, Any]], body: Any,
                             config_kw: dict[str, Any] | None = None, **extra: Any) -> None:
    config = fast_config(transport, **(config_kw or {}))
    async with sender_child(config, LAYOUT_F32, 16, 4, plan, **extra) as (receiver, peer):
        await body(receiver, peer)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sender_killed_mid_transfer(transport: str) -> None:
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

    # an in-place receiver frees the blocks only past the grant's bound (io_timeout_s + the
    # copy budget + a margin after the last frame): short ones here, the test waits them out
    asyncio.run(_with_sender_child(transport, TWO_WRITES, body, stop_after_first_write=True,
                                   config_kw=dict(io_timeout_s=1.0, copy_budget_s=0.5)))


@pytest.mark.timeout(60)
def test_hung_sender_hits_the_lease() -> None:
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
def test_receiver_killed_or_hung(transport: str, fault: str) -> None:
    async def main() -> None:
        config = fast_config(transport)
        plan = [{"xfer": "r1", "gen": 1, "dst": [[0], [1], [2], [3]]}]
        peer = await PeerProcess(spec("receiver", config, LAYOUT_F32, 8, plan)).start()
        sender = start_sender(config, LAYOUT_F32, 8, seed=3)
        try:
            conn = await sender.connect((await peer.line())["address"])
            await sender.begin(conn, [Region(0), Region(1)], "r1", 1)
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
def test_corrupted_payload_fails_checksum(transport: str) -> None:
    async def body(receiver: Any, peer: PeerProcess) -> None:
        future = receiver.expect("r1", [Region(5), Region(9)], 1)
        await peer.start()
        assert (await peer.line())["ready"]
        verdict = await peer.line()
        assert (verdict["ok"], verdict["kind"]) == (False, "integrity")
        with pytest.raises(IntegrityError):
            await asyncio.wait_for(future, 5)

    # The failure resolves once the sender answered the grant's REVOKE, or (a sender
    # that closed first) at the grant's bound: io_timeout + copy budget + 0.5 s
    asyncio.run(_with_sender_child(transport, TWO_WRITES, body, corrupt=True,
                                   config_kw={"io_timeout_s": 1.0, "copy_budget_s": 0.5}))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_late_write_after_abort_is_dropped(transport: str) -> None:
    """A sender writes into a transfer the receiver fenced and whose blocks it reused
    under a new generation: its write is dropped (counted), its verdict is the fence's,
    and nothing lands. (Both sides in this process: the fence is the receiver's alone.)"""
    async def main() -> None:
        async with connected(fast_config(transport), LAYOUT_F32, 16, 4, seed=1) as (r, s, peer):
            future = r.expect("r1", [Region(5), Region(9)], 1)
            assert r.cancel("r1", "request aborted")
            with pytest.raises(TransferCancelled):
                await future
            reused = r.expect("r1", [Region(5), Region(9)], 2)  # the blocks, reused at once
            with pytest.raises(TransferCancelled):
                await s.begin(peer, [Region(5), Region(9)], "r1", 1)
                for src, dst in ((0, 5), (1, 9)):
                    await s.write(peer, [Region(src)], [Region(dst)], "r1", 1, checksum=True)
                await s.finish(peer, "r1", 1)
            assert r.metrics.value("splitserve:kv_transfer_stale_writes_dropped_total") >= 1
            assert not r.kv.tensor.any(), "a stale write landed"
            assert not reused.done()
            r.cancel("r1")

    asyncio.run(main())


@pytest.mark.timeout(60)
@NO_UCX
def test_ucx_remote_key_only_after_the_token_proof() -> None:
    """The receiver's remote keys (one per rank cache) open its caches to RMA puts: a
    peer without the cluster token gets REFUSE and no key; one with it gets the keys in
    WELCOME."""
    import json
    import socket

    from kvtransfer import wire

    async def hello(address: str, token: str) -> tuple[wire.Frame, dict[str, Any]]:
        addr, loop = json.loads(address), asyncio.get_running_loop()
        with socket.create_connection((addr["host"], addr["port"])) as sock:
            sock.setblocking(False)
            _, challenge = await wire.expect_json(loop, sock, wire.Frame.CHALLENGE)
            mine = wire.nonce()
            await wire.send_all(loop, sock, wire.pack_json(wire.Frame.HELLO, {
                "proof": wire.proof(token, b"c", bytes.fromhex(challenge["nonce"]), mine),
                "nonce": mine.hex(), "transport": "ucx", "layout": addr["layout"],
                "version": wire.PROTOCOL_VERSION}))
            return await wire.expect_json(loop, sock, wire.Frame.WELCOME, wire.Frame.REFUSE)

    async def main() -> None:
        config = fast_config("ucx")
        receiver = await start_receiver(config, LAYOUT_F32, 16)
        try:
            kind, reply = await hello(receiver.address(), "not-the-token")
            assert kind is wire.Frame.REFUSE and "rkeys" not in reply
            kind, reply = await hello(receiver.address(), config.token)
            assert kind is wire.Frame.WELCOME and reply["rkeys"] and reply["ucx_worker"]
            assert "rkey" not in receiver.address()
        finally:
            await receiver.close()

    asyncio.run(main())


@pytest.mark.timeout(180)
@NO_UCX
def test_ucx_receiver_killed_during_the_copy(tmp_path: Any) -> None:
    """A ucx receiver on this node SIGKILLed while a 128 MiB write's copy runs (its first
    bytes landed, its last not: the receiver watches its cache and kills itself): the
    hand-off fails with PeerUnavailable (the write, or its verdict when the copy's last
    calls still met the dying process's memory), and the sender (this process) lives on
    and hands off to the next receiver. Three such kills, each at another point of the
    copy; on this shared box the watcher is sometimes scheduled only after the copy
    ended (that attempt does not count), so up to eight attempts."""
    import torch

    from kvtransfer import KVLayout, make_sender

    layout = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, block_size=16,
                      dtype="float32")  # 1 MiB blocks
    blocks, config = 128, fast_config("ucx")
    sender = make_sender(config)
    # 1.1f is cd cc 8c 3f: no zero byte, so a landed byte reads as non-zero
    sender.register(torch.full(layout.tensor_shape(blocks), 1.1), layout)

    async def one(plan: list[dict[str, Any]], **die: str) -> tuple[PeerProcess, Any]:
        peer = await PeerProcess(spec("receiver", config, layout, blocks, plan, **die)).start()
        conn = await sender.connect((await peer.line())["address"])
        await sender.begin(conn, [Region(0, num_blocks=blocks)], "r1", 1)
        return peer, conn

    async def main() -> None:
        plan = [{"xfer": "r1", "gen": 1, "dst": [[0, 0, None, blocks]]}]
        kills = 0
        try:
            for attempt in range(8):
                verdict = tmp_path / f"verdict-{attempt}"
                verdict.write_bytes(b"\0")
                peer, conn = await one(plan, die_mid_write=str(verdict))
                try:
                    failed = False
                    try:
                        await sender.write(conn, [Region(0, num_blocks=blocks)],
                                           [Region(0, num_blocks=blocks)], "r1", 1)
                        await sender.finish(conn, "r1", timeout_s=10.0)
                    except PeerUnavailable:
                        failed = True
                    assert await peer.wait(10) == -signal.SIGKILL
                    if verdict.read_bytes() == b"\1":  # killed during the copy
                        assert failed, "a hand-off into a killed receiver succeeded"
                        kills += 1
                finally:
                    await peer.aclose()
                if kills == 3:
                    break
            assert kills == 3, f"{kills} of 8 kills landed during the copy"
            peer, conn = await one(plan)  # the sender lives on: the next hand-off lands
            try:
                await sender.write(conn, [Region(0, num_blocks=blocks)],
                                   [Region(0, num_blocks=blocks)], "r1", 1)
                assert (await peer.line())["ok"]  # landed, verified
            finally:
                await peer.aclose()
        finally:
            await sender.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
@NO_UCX
def test_ucx_set_up_past_its_deadline_is_a_typed_error() -> None:
    """The receiver's UCX worker makes no progress, so the wire-up of the sender's lanes
    (a small get, RMA over TCP here) never completes: connect raises PeerUnavailable
    within io_timeout_s, not a bare TimeoutError; the sender's lanes, opened before the
    deadline started, serve the next connection."""
    from kvtransfer.ucx_lanes import EPOLL_MS

    async def main() -> None:
        config = fast_config("ucx", io_timeout_s=1.0, ucx_options=(("TLS", "tcp,self"),),
                             ucx_host_copy=False)  # UCX's own path, as between hosts
        receiver = await start_receiver(config, LAYOUT_F32, 16)
        sender = start_sender(config, LAYOUT_F32, 4, seed=3)
        worker = receiver._lanes[0].worker
        try:
            worker.stop_progress_thread()
            with pytest.raises(PeerUnavailable, match="set-up"):
                await sender.connect(receiver.address())
            worker.start_progress_thread(polling_mode=False, epoll_timeout=EPOLL_MS)
            # the second set-up has room: a restarted worker on a loaded box is slow
            sender.config = dataclasses.replace(config, io_timeout_s=10.0)
            peer = await sender.connect(receiver.address())
            landed = receiver.expect("x", [Region(3)], 1)
            await sender.write(peer, [Region(1)], [Region(3)], "x", 1)
            await sender.finish(peer, "x", 1)
            await asyncio.wait_for(landed, 5)
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(main())
