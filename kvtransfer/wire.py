"""Control-channel framing and the authenticated handshake, over raw sockets.

Raw non-blocking sockets with `loop.sock_recv_into` (not StreamReader, which
buffers) so tcp payloads land straight in the destination blocks.

Frame: `!BIQ` header = type, meta length, payload length; then meta; then payload.
Handshake (mutual, the token never crosses the wire):

    receiver -> CHALLENGE {nonce, version}
    sender   -> HELLO {proof = HMAC(token, "c" nonce client_nonce), layout, transport,
                       version}
    receiver -> WELCOME {proof = HMAC(token, "s" client_nonce nonce), conn_id, extra}
             |  REFUSE {kind: version | auth | layout | transport, message}

Both sides check the version first: a sender refuses a CHALLENGE of another version
before it sends anything, a receiver a HELLO of another (or none: version 1 sent
none), each with `VersionMismatch` naming both versions.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import socket
import struct
import sys
from enum import IntEnum
from typing import Any

from kvtransfer.errors import PeerUnavailable, ProtocolError, VersionMismatch

# A deadline scope on the hand-off's path (no task of its own, as wait_for's would be);
# it raises the builtin TimeoutError.
if sys.version_info >= (3, 11):
    from asyncio import timeout as deadline
else:  # Python 3.10: async_timeout (a dependency of redis's there too)
    import contextlib

    from async_timeout import timeout as _timeout

    @contextlib.asynccontextmanager
    async def deadline(delay: float | None):  # type: ignore[no-untyped-def]
        try:
            async with _timeout(delay):
                yield
        except asyncio.TimeoutError:  # not the builtin before 3.11
            raise TimeoutError from None

# Bump on any change a peer of the previous version would misread. History:
#   1: WRITE frames carry the bytes (tcp, shm); ucx as tagged messages.
#   2: in-place writers (RESERVE / GRANT / WRITTEN, one notice per chunk) for shm,
#      cuda_ipc and ucx RMA; WELCOME carries the exported cache or the remote key;
#      HELLO carries the version.
#   3: tensor parallelism: HELLO and WELCOME carry each side's TP size; a region names
#      its rank and KV head range (WRITE header, RESERVE), so each rank's heads move
#      between the two sides' rank caches directly (`layout.rank_pairs`).
#   4: a tcp WRITE frame carries a chunk's regions as rows of one int64 array
#      (`tcp_frames`), not one region; PrefillResponse and FetchKVResponse carry a
#      float8 cache's KV scales; in-place writers hold one revocable grant per transfer,
#      asked for once (RESERVE of the transfer's whole destination, at `begin`): each
#      WRITTEN names the regions it landed; the receiver REVOKEs a failed transfer's
#      grant and the sender answers REVOKED once none of its writes is in flight.
#   5: a tcp receiver answers every WRITE frame with the transfer's RESULT (a dropped
#      one as a FINISH), so a tcp sender that wrote sends no FINISH.
#   6: RESERVE and WRITTEN carry their regions as the frame's payload (packed rows,
#      `region_rows.pack_rows`), not as base64 text in their meta.
PROTOCOL_VERSION = 6
HEADER = struct.Struct("!BIQ")
MAX_META = 1 << 20


class Frame(IntEnum):
    CHALLENGE = 1
    HELLO = 2
    WELCOME = 3
    REFUSE = 4
    WRITE = 5  # tcp: a chunk's regions (`tcp_frames`), their bytes as the payload
    FINISH = 6
    RESULT = 7
    CANCEL = 8
    PING = 9
    PONG = 10
    RESERVE = 11
    GRANT = 12
    WRITTEN = 13  # in-place writers: these regions of a grant are in place (one notice)
    REVOKE = 14  # receiver -> in-place writer: stop writing into this grant, then answer
    REVOKED = 15  # in-place writer -> receiver: nothing of mine lands in that grant now


def version_mismatch(theirs: Any, who: str) -> VersionMismatch | None:
    """The error to refuse a peer with, unless `theirs` (from its CHALLENGE or HELLO;
    None when it sent none) is this build's PROTOCOL_VERSION."""
    if theirs == PROTOCOL_VERSION:
        return None
    return VersionMismatch(
        f"the {who} speaks kvtransfer protocol version {theirs or '1 or older'}, this "
        f"worker version {PROTOCOL_VERSION}: run one splitserve version on both sides")


def proof(token: str, tag: bytes, first: bytes, second: bytes) -> str:
    return hmac.new(token.encode(), tag + first + second, hashlib.sha256).hexdigest()


def nonce() -> bytes:
    return os.urandom(16)


def pack_json(kind: Frame, obj: dict[str, Any], payload: bytes = b"") -> bytes:
    """A frame of `obj` and `payload` (a control frame's: RESERVE's and WRITTEN's packed
    rows). ValueError for a meta or control payload larger than a receiver reads
    (`MAX_META` each)."""
    meta = json.dumps(obj).encode()
    if len(meta) > MAX_META or len(payload) > MAX_META:
        raise ValueError(f"a {kind.name} frame of {len(meta)} + {len(payload)} bytes "
                         f"(at most {MAX_META} each)")
    return HEADER.pack(kind, len(meta), len(payload)) + meta + payload


def pack_frame(kind: Frame, meta: bytes = b"", payload_len: int = 0) -> bytes:
    return HEADER.pack(kind, len(meta), payload_len) + meta


async def recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                     view: memoryview) -> None:
    """Fill `view` from `sock`; PeerUnavailable on EOF or reset."""
    got, n = 0, len(view)
    while got < n:
        try:
            k = await loop.sock_recv_into(sock, view[got:])
        except OSError as e:
            raise PeerUnavailable(f"connection lost: {e}") from e
        if k == 0:
            raise PeerUnavailable("peer closed the connection")
        got += k


async def read_frame(loop: asyncio.AbstractEventLoop,
                     sock: socket.socket) -> tuple[Frame, bytes, int]:
    """Read a frame's header and meta; the caller consumes `payload_len` bytes after."""
    head = bytearray(HEADER.size)
    await recv_exact(loop, sock, memoryview(head))
    kind, meta_len, payload_len = HEADER.unpack(head)
    if meta_len > MAX_META:
        raise ProtocolError(f"frame meta of {meta_len} bytes is too large")
    meta = bytearray(meta_len)
    if meta_len:
        await recv_exact(loop, sock, memoryview(meta))
    try:
        return Frame(kind), bytes(meta), payload_len
    except ValueError:
        raise ProtocolError(f"unknown frame type {kind}") from None


async def expect_json(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                      *kinds: Frame) -> tuple[Frame, dict[str, Any]]:
    kind, meta, payload_len = await read_frame(loop, sock)
    if kind not in kinds or payload_len:
        raise ProtocolError(f"expected {[k.name for k in kinds]}, got {kind.name}")
    return kind, json.loads(meta)


async def send_all(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: Any) -> None:
    try:
        await loop.sock_sendall(sock, data)
    except OSError as e:
        raise PeerUnavailable(f"connection lost: {e}") from e


def tune_socket(sock: socket.socket, buffer_bytes: int) -> None:
    """Large buffers and no Nagle: regions are big, control frames latency-bound."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


CANCEL_WAIT_S = 1.0  # a cancelled socket task ends within a loop turn; this is slack


async def cancel_all(tasks: list[asyncio.Task[Any]], timeout_s: float = CANCEL_WAIT_S) -> int:
    """Cancels `tasks` and waits (bounded) for them to end, so that closing a
    connection never waits on a peer, dead or alive. Returns how many did not end in
    time (left running; the caller closes their socket under them)."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return 0
    _, stuck = await asyncio.wait(tasks, timeout=timeout_s)
    return len(stuck)
