"""The receiving (decode) side shared by all transports: control server, handshake,
leases, fencing, results. Transports add only how a WRITE's bytes land.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry

from kvtransfer import wire
from kvtransfer.config import TransferConfig
from kvtransfer.errors import (
    KVTransferError,
    LayoutMismatch,
    PeerUnavailable,
    ProtocolError,
    TransferCancelled,
)
from kvtransfer.fencing import TransferTable
from kvtransfer.layout import KVLayout, Region
from kvtransfer.memory import RegisteredKV
from kvtransfer.metrics import TransferMetrics
from kvtransfer.wire import Frame

log = logging.getLogger(__name__)
_RESULTS_KEPT = 4096  # outcomes remembered for a FINISH that arrives after completion
# the frames from a sender that carry a payload (their `payload_len` bytes follow)
_WITH_PAYLOAD = (Frame.WRITE, Frame.RESERVE, Frame.WRITTEN)


class Conn:
    """One authenticated sender connection."""

    def __init__(self, conn_id: int, sock: socket.socket, peer: str) -> None:
        self.id = conn_id
        self.sock = sock
        self.peer = peer
        self.send_lock = asyncio.Lock()
        self.last_rx = asyncio.get_running_loop().time()
        self.task: asyncio.Task[None] | None = None
        # RESULT frames of transfers that this connection's own frame resolved: its frame
        # loop sends them once that frame is handled, with no task of their own
        self.results: list[bytes] = []


class ReceiverBase:
    """Accepts authenticated senders and lands their writes in the registered cache.

    Lifecycle: `register(kv, layout)`, `await start()`, hand `address()` to senders,
    then per transfer `expect(...)` and await the returned future. `close()` fails
    everything pending with PeerUnavailable and releases sockets (and segments).
    """

    name: ClassVar[str] = ""

    def __init__(self, config: TransferConfig, registry: CollectorRegistry | None = None) -> None:
        if config.transport != self.name:
            raise ValueError(f"{type(self).__name__} needs transport={self.name!r}")
        self.config = config
        self.metrics = TransferMetrics("receiver", self.name, registry)
        self.kv: RegisteredKV | None = None
        self._table: TransferTable | None = None
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._conns: dict[int, Conn] = {}
        self._next_conn = 1
        self._results: OrderedDict[tuple[str, int], KVTransferError | None] = OrderedDict()
        self._finish_waiters: dict[str, set[int]] = {}

    # ----- public API ---------------------------------------------------------------
    def register(self, kv: Any, layout: KVLayout) -> None:
        """Register the local KV cache (once). The caller keeps owning the tensor."""
        if self.kv is not None:
            raise RuntimeError("KV memory is already registered")
        self.kv = RegisteredKV(kv, layout)
        self._table = TransferTable(self.kv.rank_layout, self.kv.num_blocks, self.metrics,
                                    self._on_resolved, self._on_abort, tp=self.kv.tp)

    async def start(self) -> None:
        """Listen for senders on config.host:config.port (0 = pick a free port)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        sock.listen(128)
        sock.setblocking(False)
        self._listener = sock
        self._spawn(self._accept_loop())
        self._spawn(self._liveness_loop())

    def address(self) -> str:
        """Descriptor a sender connects with: transport, host:port, layout (+ extras)."""
        if self._listener is None or self.kv is None:
            raise RuntimeError("register() and start() first")
        host, port = self._listener.getsockname()[:2]
        return json.dumps({"transport": self.name, "host": host, "port": port,
                           "layout": json.loads(self.kv.layout.to_json()),
                           **self._address_extra()})

    def expect(self, xfer_id: str, dst_regions: Sequence[Region], generation: int,
               lease_s: float | None = None) -> asyncio.Future[None]:
        """Announce an incoming transfer; the future resolves when every region landed
        and verified, or fails (typed) once the blocks are safe to reuse. Under tensor
        parallelism a region of the worker's blocks is expected on every rank: the
        transfer completes when each rank's heads of it landed, and a failure of any
        rank's slice fails the whole."""
        lease = self.config.lease_s if lease_s is None else lease_s
        self._results.pop((xfer_id, generation), None)
        if self.kv is not None and self.kv.tp > 1:
            dst_regions = [replace(r, rank=k) for r in dst_regions for k in range(self.kv.tp)]
        return self.table.expect(xfer_id, dst_regions, generation, lease)

    def cancel(self, xfer_id: str, reason: str = "cancelled by receiver") -> bool:
        """Fence a transfer (abort or timeout): late writes for it are dropped."""
        return self.table.cancel(xfer_id, reason)

    fence = cancel

    async def close(self) -> None:
        if self._table is not None:
            self._table.fail_all(PeerUnavailable("receiver closed"))
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if stuck := await wire.cancel_all(list(self._tasks)):
            log.warning("%d receiver task(s) did not end on cancel; closing anyway", stuck)
        for conn in list(self._conns.values()):
            conn.sock.close()
        self._conns.clear()
        self._close_memory()
        # Let go of the cache: what may still refer to this receiver (a cancelled task's
        # or a logged error's traceback, e.g. in a test's log capture) must not keep the
        # engine's KV memory alive (on the GPU, 64 KiB found held so in tests/gpu).
        self.kv = None

    @property
    def table(self) -> TransferTable:
        if self._table is None:
            raise RuntimeError("register() the KV cache first")
        return self._table

    # ----- transport hooks ----------------------------------------------------------
    def _address_extra(self) -> dict[str, Any]:
        return {}

    async def _welcome(self, conn: Conn, hello: dict[str, Any]) -> dict[str, Any]:
        """Set up transport state for an authenticated sender (its HELLO: what it
        registered); returns extra WELCOME fields. A KVTransferError refuses it."""
        return {}

    async def _on_write(self, conn: Conn, meta: bytes, payload_len: int) -> None:
        """A WRITE frame (its meta read; `payload_len` bytes follow on the stream): tcp
        lands it; the in-place transports refuse it, their bytes land in place."""
        raise ProtocolError(f"{self.name} bytes land in place; WRITE frames carry none")

    async def _on_reserve(self, conn: Conn, msg: dict[str, Any],
                          rows: bytes | bytearray) -> None:
        """A RESERVE frame: its meta and its payload, the packed rows it asks for."""
        raise ProtocolError(f"{self.name} does not take RESERVE frames")

    async def _on_written(self, conn: Conn, msg: dict[str, Any],
                          rows: bytes | bytearray) -> None:
        """A WRITTEN frame: its meta and its payload, the packed rows it landed."""
        raise ProtocolError(f"{self.name} does not take WRITTEN frames")

    def _on_revoked(self, conn: Conn, msg: dict[str, Any]) -> None:
        raise ProtocolError(f"{self.name} does not take REVOKED frames")

    def _on_abort(self, xfer_id: str, writers: set[int]) -> None:
        """Writers hold in-flight writes into failed `xfer_id` (default: liveness)."""

    def _on_conn_closed(self, conn: Conn) -> None:
        pass

    def _close_memory(self) -> None:
        pass

    # ----- connection handling ------------------------------------------------------
    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            sock, addr = await loop.sock_accept(self._listener)
            wire.tune_socket(sock, self.config.socket_buffer_bytes)
            self._spawn(self._serve(sock, f"{addr[0]}:{addr[1]}"))

    async def _serve(self, sock: socket.socket, peer: str) -> None:
        conn: Conn | None = None
        try:
            conn = await asyncio.wait_for(self._handshake(sock, peer), self.config.io_timeout_s)
            if conn is None:
                return
            conn.task = asyncio.current_task()
            await self._frame_loop(conn)
        except (KVTransferError, OSError, asyncio.TimeoutError) as e:
            level = logging.INFO if isinstance(e, PeerUnavailable) else logging.WARNING
            log.log(level, "connection from %s ended: %r", peer, e)
        finally:
            if conn is not None:
                self._drop_conn(conn, PeerUnavailable(f"sender {peer} disconnected"))
            sock.close()

    async def _handshake(self, sock: socket.socket, peer: str) -> Conn | None:
        loop = asyncio.get_running_loop()
        challenge = wire.nonce()
        await wire.send_all(loop, sock, wire.pack_json(Frame.CHALLENGE, {
            "nonce": challenge.hex(), "version": wire.PROTOCOL_VERSION}))
        _, hello = await wire.expect_json(loop, sock, Frame.HELLO)
        client_nonce = bytes.fromhex(str(hello.get("nonce", "")))
        want = wire.proof(self.config.token, b"c", challenge, client_nonce)
        reason, message = "", ""
        if (mismatch := wire.version_mismatch(hello.get("version"), "sender")) is not None:
            reason, message = "version", str(mismatch)
        elif not wire.hmac.compare_digest(want, str(hello.get("proof", ""))):
            reason, message = "auth", "shared token proof failed"
        elif hello.get("transport") != self.name:
            reason, message = "transport", f"receiver speaks {self.name}"
        else:
            try:  # the model's layout (every head): the TP sizes may differ
                assert self.kv is not None
                self.kv.layout.check_same(KVLayout(**hello["layout"]))
            except (LayoutMismatch, TypeError, ValueError) as e:
                reason, message = "layout", str(e)
        conn = Conn(self._next_conn, sock, peer)
        extra: dict[str, Any] = {}
        if not reason:
            self._next_conn += 1
            try:
                extra = await self._welcome(conn, hello)
            except (KVTransferError, KeyError, TypeError, ValueError) as e:
                self._on_conn_closed(conn)
                reason, message = "transport", f"cannot set up {self.name}: {e}"
        if reason:
            self.metrics.refused(reason)
            log.warning("refused sender %s: %s (%s)", peer, reason, message)
            await wire.send_all(loop, sock, wire.pack_json(
                Frame.REFUSE, {"kind": reason, "message": message}))
            return None
        await wire.send_all(loop, sock, wire.pack_json(Frame.WELCOME, {
            "proof": wire.proof(self.config.token, b"s", client_nonce, challenge),
            "conn_id": conn.id, "tp": self.table.tp, **extra}))
        self._conns[conn.id] = conn
        log.info("accepted sender %s as connection %d", peer, conn.id)
        return conn

    async def _frame_loop(self, conn: Conn) -> None:
        loop = asyncio.get_running_loop()
        while True:
            kind, meta, payload_len = await wire.read_frame(loop, conn.sock)
            conn.last_rx = loop.time()
            if payload_len and kind not in _WITH_PAYLOAD:  # its bytes would read as frames
                raise ProtocolError(f"a {kind.name} frame names a payload of {payload_len} "
                                    "bytes; it carries none")
            if kind is Frame.WRITE:
                await self._on_write(conn, meta, payload_len)
            elif kind is Frame.PING:
                await self._send(conn, wire.pack_frame(Frame.PONG))
            elif kind is Frame.FINISH:
                await self._on_finish(conn, json.loads(meta))
            elif kind is Frame.CANCEL:
                msg = json.loads(meta)
                if self.table.generation_of(msg["xfer"]) == msg["gen"]:
                    self.table.fail(msg["xfer"], TransferCancelled(
                        f"{msg['xfer']}: cancelled by sender ({msg.get('reason', '')})"))
            elif kind is Frame.RESERVE:
                rows = await _read_rows(loop, conn, payload_len)
                await self._on_reserve(conn, json.loads(meta), rows)
            elif kind is Frame.WRITTEN:
                rows = await _read_rows(loop, conn, payload_len)
                await self._on_written(conn, json.loads(meta), rows)
            elif kind is Frame.REVOKED:
                self._on_revoked(conn, json.loads(meta))
            else:
                raise ProtocolError(f"unexpected {kind.name} frame from a sender")
            if conn.results:
                frames, conn.results = conn.results, []
                await self._send(conn, b"".join(frames))

    async def _on_finish(self, conn: Conn, msg: dict[str, Any]) -> None:
        xfer_id, gen = str(msg["xfer"]), int(msg["gen"])
        if self.table.generation_of(xfer_id) == gen:
            self._finish_waiters.setdefault(xfer_id, set()).add(conn.id)
            return
        key = (xfer_id, gen)
        error = self._results[key] if key in self._results else \
            TransferCancelled(f"{xfer_id} gen {gen} is not expected (fenced or unknown)")
        await self._send(conn, _result_frame(xfer_id, gen, error))

    async def _send(self, conn: Conn, data: bytes) -> None:
        async with conn.send_lock, wire.deadline(self.config.io_timeout_s):
            await wire.send_all(asyncio.get_running_loop(), conn.sock, data)

    def _on_resolved(self, xfer_id: str, gen: int, error: KVTransferError | None,
                     writers: set[int]) -> None:
        self._results[(xfer_id, gen)] = error
        while len(self._results) > _RESULTS_KEPT:
            self._results.popitem(last=False)
        targets = self._finish_waiters.pop(xfer_id, set()) | writers
        try:
            current = asyncio.current_task()
        except RuntimeError:  # no loop running: nothing is resolved by a frame
            current = None
        for conn_id in targets:
            conn = self._conns.get(conn_id)
            if conn is None:
                continue
            frame = _result_frame(xfer_id, gen, error)
            if current is not None and conn.task is current:
                conn.results.append(frame)  # resolved by a frame of its own: sent next
            else:
                self._spawn(self._send_quietly(conn, frame))

    async def _send_quietly(self, conn: Conn, data: bytes) -> None:
        with contextlib.suppress(KVTransferError, OSError, asyncio.TimeoutError):
            await self._send(conn, data)

    def _drop_conn(self, conn: Conn, error: KVTransferError) -> None:
        if self._conns.pop(conn.id, None) is None:
            return
        self._on_conn_closed(conn)
        if self._table is not None:
            self._table.fail_writer(conn.id, error)

    async def _liveness_loop(self) -> None:
        """Close connections silent past liveness_timeout_s (senders ping every
        heartbeat_s), which fails their transfers with PeerUnavailable."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            now = loop.time()
            for conn in list(self._conns.values()):
                if now - conn.last_rx > self.config.liveness_timeout_s and conn.task:
                    log.warning("sender %s silent for %.1fs; closing", conn.peer,
                                now - conn.last_rx)
                    conn.task.cancel()


async def _read_rows(loop: asyncio.AbstractEventLoop, conn: Conn,
                     payload_len: int) -> bytearray:
    """A control frame's payload (packed rows), at most `wire.MAX_META` bytes, in the
    buffer it was read into (`region_rows.rows_from_wire` reads it in place)."""
    if payload_len > wire.MAX_META:
        raise ProtocolError(f"a control frame payload of {payload_len} bytes is too large")
    rows = bytearray(payload_len)
    if payload_len:
        await wire.recv_exact(loop, conn.sock, memoryview(rows))
    return rows


def _result_frame(xfer_id: str, gen: int, error: KVTransferError | None) -> bytes:
    return wire.pack_json(Frame.RESULT, {
        "xfer": xfer_id, "gen": gen, "ok": error is None,
        "kind": "" if error is None else error.kind,
        "message": "" if error is None else str(error)})
