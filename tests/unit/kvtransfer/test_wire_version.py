"""The wire protocol's version is checked first at the handshake, both ways: a peer of
another version (version 1 sent none in HELLO) gets a typed `VersionMismatch` naming
both versions, before any proof, key or byte of KV crosses."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from kvtransfer import VersionMismatch, wire
from kvtransfer.errors import error_from_kind
from tests.integration.kvtransfer_util import LAYOUT_F32, fast_config, start_receiver, start_sender


def test_a_sender_refuses_a_receiver_of_another_version_before_saying_anything() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        sender = start_sender(fast_config("tcp"), LAYOUT_F32, 4, seed=1)

        async def old_receiver() -> bytes:  # what a version-1 receiver says first
            sock, _ = await loop.sock_accept(listener)
            with sock:
                await wire.send_all(loop, sock, wire.pack_json(
                    wire.Frame.CHALLENGE, {"nonce": wire.nonce().hex(), "version": 1}))
                return await asyncio.wait_for(loop.sock_recv(sock, 1024), 5)

        server = asyncio.create_task(old_receiver())
        address = json.dumps({"transport": "tcp", "host": "127.0.0.1",
                              "port": listener.getsockname()[1]})
        try:
            with pytest.raises(VersionMismatch, match=f"version 1, .* version "
                                                      f"{wire.PROTOCOL_VERSION}"):
                await sender.connect(address)
            assert await server == b"", "the sender sent a HELLO to a peer it cannot speak to"
        finally:
            await sender.close()
            listener.close()

    asyncio.run(main())


@pytest.mark.parametrize("theirs", [None, 1, 3, wire.PROTOCOL_VERSION - 1,
                                    wire.PROTOCOL_VERSION + 1])
def test_a_receiver_refuses_a_sender_of_another_version(theirs: int | None) -> None:
    """Version 3 is the per-chunk RESERVE/GRANT protocol: its WRITTEN names no regions
    and it knows no REVOKE, so a version 3 peer is refused, not misread; the version
    just before this one (whose tcp writers still send FINISH) is refused too."""
    async def main() -> None:
        config = fast_config("tcp")
        receiver = await start_receiver(config, LAYOUT_F32, 4)
        addr, loop = json.loads(receiver.address()), asyncio.get_running_loop()
        try:
            with socket.create_connection((addr["host"], addr["port"])) as sock:
                sock.setblocking(False)
                _, challenge = await wire.expect_json(loop, sock, wire.Frame.CHALLENGE)
                assert challenge["version"] == wire.PROTOCOL_VERSION
                mine = wire.nonce()
                hello = {"proof": wire.proof(config.token, b"c",
                                             bytes.fromhex(challenge["nonce"]), mine),
                         "nonce": mine.hex(), "transport": "tcp", "layout": addr["layout"]}
                if theirs is not None:  # version 1 sent none
                    hello["version"] = theirs
                await wire.send_all(loop, sock, wire.pack_json(wire.Frame.HELLO, hello))
                kind, reply = await wire.expect_json(loop, sock, wire.Frame.WELCOME,
                                                     wire.Frame.REFUSE)
            assert kind is wire.Frame.REFUSE and reply["kind"] == "version"
            assert f"version {wire.PROTOCOL_VERSION}" in reply["message"]
            assert f"version {theirs or '1 or older'}" in reply["message"]
            assert "run one splitserve version on both sides" in reply["message"]
            assert isinstance(error_from_kind(reply["kind"], reply["message"]), VersionMismatch)
            assert receiver.metrics.value("splitserve:kv_transfer_handshakes_refused_total",
                                          reason="version") == 1
        finally:
            await receiver.close()

    asyncio.run(main())
