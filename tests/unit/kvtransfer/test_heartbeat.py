"""The sender's heartbeat stops when cancelled, even when the cancel lands in the same
loop iteration as its PING's send completes (on Python 3.11 asyncio.wait_for swallows
such a cancel: a heartbeat that went on would keep extending in-place grants' window)."""

from __future__ import annotations

import asyncio
import collections
from types import SimpleNamespace

from kvtransfer import sender as sender_mod
from kvtransfer.sender import SenderBase


def test_a_heartbeat_cancelled_as_its_ping_is_sent_sends_no_more(monkeypatch) -> None:
    sends: list[asyncio.Future[None]] = []

    async def send_all(loop, sock, data) -> None:  # noqa: ANN001 - wire.send_all's
        fut = loop.create_future()
        sends.append(fut)
        await fut

    monkeypatch.setattr(sender_mod.wire, "send_all", send_all)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        peer = SimpleNamespace(alive=True, last_rx=loop.time() + 60, sock=None,
                               send_lock=asyncio.Lock(), pings=collections.deque())
        owner = SimpleNamespace(config=SimpleNamespace(heartbeat_s=0.0,
                                                       liveness_timeout_s=60.0,
                                                       io_timeout_s=5.0),
                                _fail_peer=lambda peer, error: None)
        task = asyncio.create_task(SenderBase._heartbeat(owner, peer))  # type: ignore[arg-type]
        while not sends:
            await asyncio.sleep(0)
        sends[0].set_result(None)  # the PING goes out ...
        task.cancel()  # ... as the heartbeat is cancelled
        for _ in range(20):
            await asyncio.sleep(0)
        assert task.cancelled()
        assert len(sends) == 1 and len(peer.pings) == 1

    asyncio.run(main())
