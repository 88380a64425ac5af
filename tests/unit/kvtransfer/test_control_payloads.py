"""A control frame that carries no payload but names one (`payload_len` > 0) is a
protocol error that ends its connection, on either side: its payload's bytes are never
read as the frames that follow."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
import torch

from kvtransfer import KVLayout, wire
from kvtransfer.errors import PeerUnavailable, ProtocolError
from kvtransfer.inplace import InPlaceReceiver
from kvtransfer.receiver import Conn, ReceiverBase
from kvtransfer.sender import Peer
from kvtransfer.shm import ShmSender
from kvtransfer.wire import Frame
from tests.integration.kvtransfer_util import fast_config

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=1, dtype="float32")
# what the named payload holds: a frame of its own, which a reader out of step would take
# for the next frame and answer
HIDDEN = wire.pack_frame(Frame.PING)


def framed(kind: Frame, meta: dict[str, object]) -> bytes:
    return wire.pack_frame(kind, json.dumps(meta).encode(), len(HIDDEN)) + HIDDEN


class Receiver(InPlaceReceiver):
    name = "shm"  # the in-place receiver's frame handling alone, no segment


@pytest.mark.parametrize("kind,meta", [
    (Frame.PING, {}), (Frame.FINISH, {"xfer": "x", "gen": 1}),
    (Frame.CANCEL, {"xfer": "x", "gen": 1}), (Frame.REVOKED, {"req": 5})])
def test_a_receiver_ends_a_connection_whose_frame_names_a_stray_payload(
        kind: Frame, meta: dict[str, object]) -> None:
    async def main() -> None:
        r = Receiver(fast_config("shm"))
        ReceiverBase.register(r, torch.zeros(LAYOUT.tensor_shape(4)), LAYOUT)
        a, b = socket.socketpair()
        a.setblocking(False)
        try:
            b.sendall(framed(kind, meta))
            with pytest.raises(ProtocolError, match="carries none"):
                await asyncio.wait_for(r._frame_loop(Conn(7, a, "peer")), 5)
            b.setblocking(False)
            with pytest.raises(BlockingIOError):  # nothing was answered
                b.recv(1 << 16)
        finally:
            a.close()
            b.close()
            await r.close()

    asyncio.run(main())


@pytest.mark.parametrize("kind,meta", [
    (Frame.PONG, {}), (Frame.RESULT, {"xfer": "x", "gen": 1, "ok": True}),
    (Frame.GRANT, {"req": 5, "ok": True, "ttl": 1.0}),
    (Frame.REVOKE, {"req": 5, "xfer": "x", "gen": 1, "kind": "cancelled", "message": ""})])
def test_a_sender_ends_a_connection_whose_frame_names_a_stray_payload(
        kind: Frame, meta: dict[str, object]) -> None:
    async def main() -> None:
        sender = ShmSender(fast_config("shm"))
        a, b = socket.socketpair()
        a.setblocking(False)
        peer = Peer(a, {"host": "peer", "port": 0}, {"conn_id": 1})
        try:
            b.sendall(framed(kind, meta))
            await asyncio.wait_for(sender._reader(peer), 5)
            assert isinstance(peer.error, PeerUnavailable)
            assert "carries none" in str(peer.error)
        finally:
            a.close()
            b.close()

    asyncio.run(main())
