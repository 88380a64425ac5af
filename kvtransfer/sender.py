"""The sending (prefill) side shared by all transports: connect + handshake, streamed
writes with deadlines, completion from the receiver's verdict, liveness.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry

from kvtransfer import region_rows as rr
from kvtransfer import wire
from kvtransfer.config import TransferConfig
from kvtransfer.errors import (
    AuthError,
    KVTransferError,
    LayoutMismatch,
    PeerUnavailable,
    ProtocolError,
    TransferTimeout,
    VersionMismatch,
    error_from_kind,
)
from kvtransfer.layout import KVLayout, Pairs, Region, WholeBlocks, coalesce, rank_pairs
from kvtransfer.memory import Ready, RegisteredKV
from kvtransfer.metrics import TransferMetrics
from kvtransfer.wire import Frame

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Outgoing:
    generation: int
    verdict: asyncio.Future[None]
    started: float = field(default_factory=time.perf_counter)
    nbytes: int = 0
    # The receiver sends its verdict unasked (it answers every tcp WRITE frame; it granted
    # an in-place write of ours: we are a writer of the transfer), so `finish` need not
    # send FINISH.
    answered: bool = False


class Peer:
    """An authenticated connection to one receiver. Owned by the sender that made it."""

    def __init__(self, sock: socket.socket, address: dict[str, Any],
                 welcome: dict[str, Any]) -> None:
        self.sock = sock
        self.address = address
        self.welcome = welcome
        self.conn_id = int(welcome["conn_id"])
        self.send_lock = asyncio.Lock()
        self.last_rx = asyncio.get_running_loop().time()
        self.error: KVTransferError | None = None
        self.outgoing: dict[str, _Outgoing] = {}
        self.replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.state: Any = None  # transport-specific (ucx endpoint, shm mapping)
        self.grants: dict[tuple[str, int], Any] = {}  # in-place: (xfer, gen) -> its grant
        self.notices: Any = None  # in-place: write notices waiting for their copies
        # time.monotonic() when the newest request the receiver answered (HELLO, RESERVE,
        # PING) was sent: an in-place grant holds for its ttl past that instant
        self.vouched = time.monotonic()
        self.pings: deque[float] = deque()  # send times of the PINGs not answered yet

    @property
    def alive(self) -> bool:
        return self.error is None

    def check(self) -> None:
        if self.error is not None:
            raise type(self.error)(str(self.error))


class SenderBase:
    """Writes local KV regions into a remote receiver's blocks.

    Per transfer: any number of `write()` calls (as layers/chunks are produced),
    then `finish()` which returns when the receiver has every region verified, or
    raises its typed error. Each call has a deadline (config.io_timeout_s default).
    """

    name: ClassVar[str] = ""

    def __init__(self, config: TransferConfig, registry: CollectorRegistry | None = None) -> None:
        if config.transport != self.name:
            raise ValueError(f"{type(self).__name__} needs transport={self.name!r}")
        self.config = config
        self.metrics = TransferMetrics("sender", self.name, registry)
        self.kv: RegisteredKV | None = None
        self._peers: set[Peer] = set()

    def register(self, kv: Any, layout: KVLayout) -> None:
        """Register the local KV cache (the source of writes); the caller owns it."""
        if self.kv is not None:
            raise RuntimeError("KV memory is already registered")
        self.kv = RegisteredKV(kv, layout)

    async def connect(self, address: str, token: str | None = None,
                      layout: KVLayout | None = None) -> Peer:
        """Connect and handshake. Raises AuthError, LayoutMismatch, PeerUnavailable."""
        if self.kv is None:
            raise RuntimeError("register() the KV cache first")
        addr = json.loads(address)
        if addr.get("transport") != self.name:
            raise ValueError(f"address is for {addr.get('transport')!r}, not {self.name!r}")
        token = self.config.token if token is None else token
        layout = self.kv.layout if layout is None else layout
        self._open()  # local set-up: not on the clock of the network calls below
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        hello = time.monotonic()
        try:
            wire.tune_socket(sock, self.config.socket_buffer_bytes)
            await asyncio.wait_for(loop.sock_connect(sock, (addr["host"], addr["port"])),
                                   self.config.io_timeout_s)
            welcome = await asyncio.wait_for(self._handshake(sock, token, layout),
                                             self.config.io_timeout_s)
        except asyncio.TimeoutError:
            sock.close()
            raise PeerUnavailable(f"handshake with {addr['host']}:{addr['port']} timed out")\
                from None
        except OSError as e:
            sock.close()
            raise PeerUnavailable(f"cannot connect to {addr['host']}:{addr['port']}: {e}")\
                from e
        except BaseException:
            sock.close()
            raise
        peer = Peer(sock, addr, welcome)
        peer.vouched = hello
        self._peers.add(peer)
        peer.tasks = [loop.create_task(self._reader(peer)),
                      loop.create_task(self._heartbeat(peer))]
        try:
            await asyncio.wait_for(self._on_connected(peer), self.config.io_timeout_s)
        except BaseException as e:
            await self.disconnect(peer)
            if isinstance(e, asyncio.TimeoutError):
                raise PeerUnavailable(f"set-up with {addr['host']}:{addr['port']} timed out")\
                    from None
            raise
        return peer

    async def begin(self, peer: Peer, dst_regions: Sequence[Region], xfer_id: str,
                    generation: int, timeout_s: float | None = None) -> None:
        """Announce transfer `xfer_id`'s whole destination before its writes. In-place
        transports ask for its write grant here: one round trip, which the caller
        overlaps with what it does meanwhile (a prefill's compute), so that each
        `write()` then copies and notifies without waiting. A write into cells no begin
        announced extends the grant first (one more round trip, on that write's
        clock), as does a later begin of more cells; a begin of cells already granted
        asks nothing. Raises the receiver's typed error if it refuses (the transfer is
        fenced or unknown there, or its cells were granted or written before)."""
        peer.check()
        out = self._outgoing(peer, xfer_id, generation)
        if out.verdict.done():
            out.verdict.result()
        timeout = self.config.io_timeout_s if timeout_s is None else timeout_s
        try:
            async with wire.deadline(timeout):
                await self._begin(peer, dst_regions, xfer_id, generation)
        except TimeoutError:
            error = TransferTimeout(f"{xfer_id}: no write grant within {timeout}s")
            self.metrics.failure(error.kind)
            raise error from None

    async def write(self, peer: Peer, src_regions: Sequence[Region],
                    dst_regions: Sequence[Region], xfer_id: str, generation: int,
                    checksum: bool | None = None, timeout_s: float | None = None,
                    ready: Ready | None = None) -> None:
        """Write src regions (local) into dst regions (remote) of transfer `xfer_id`.

        No byte moves before `ready` (the event after the forward that wrote the src
        regions; `memory.Ready`) has completed: on the device where the transport can
        order its copy by events (cuda_ipc), on the host otherwise. Returns when the
        bytes are handed to the transport (not yet verified; see `finish`), which may
        still read the src regions until `finish` returned. Raises the transfer's error
        if the receiver already failed it.
        """
        peer.check()
        out = self._outgoing(peer, xfer_id, generation)
        if out.verdict.done():
            out.verdict.result()  # raises the receiver's error (cancelled, timeout...)
        assert self.kv is not None
        if not src_regions and not dst_regions:
            return
        pairs, nbytes = self._pairs(src_regions, dst_regions, int(peer.welcome.get("tp", 1)))
        use_checksum = self.config.checksum if checksum is None else checksum
        timeout = self.config.io_timeout_s if timeout_s is None else timeout_s
        try:
            async with wire.deadline(timeout):
                await self._send_regions(peer, pairs, xfer_id, generation, use_checksum, ready)
        except TimeoutError:
            error = TransferTimeout(f"{xfer_id}: write not delivered within {timeout}s")
            self._fail_peer(peer, error)  # a frame may be half-sent: the stream is unusable
            self.metrics.failure(error.kind)
            raise error from None
        out.nbytes += nbytes
        self.metrics.bytes.inc(nbytes)

    async def finish(self, peer: Peer, xfer_id: str, generation: int | None = None,
                     timeout_s: float | None = None) -> None:
        """Wait for the receiver's verdict on the whole transfer (all regions verified)."""
        out = peer.outgoing.get(xfer_id)
        gen = out.generation if out is not None and generation is None else generation
        if gen is None:
            raise ValueError(f"nothing was written for {xfer_id!r}; pass its generation")
        out = self._outgoing(peer, xfer_id, gen)
        timeout = self.config.io_timeout_s if timeout_s is None else timeout_s
        try:
            if not out.verdict.done() and not out.answered:
                peer.check()
                await self._send_frame(peer, wire.pack_json(
                    Frame.FINISH, {"xfer": xfer_id, "gen": gen}))
            async with wire.deadline(timeout):
                await asyncio.shield(out.verdict)
            self.metrics.completed(time.perf_counter() - out.started, out.nbytes)
        except TimeoutError:
            self.metrics.failure("timeout")
            raise TransferTimeout(f"{xfer_id}: no verdict within {timeout}s") from None
        except KVTransferError as e:
            self.metrics.failure(e.kind)
            raise
        finally:
            peer.outgoing.pop(xfer_id, None)

    async def cancel(self, peer: Peer, xfer_id: str, generation: int | None = None,
                     reason: str = "cancelled by sender") -> None:
        """Ask the receiver to fence the transfer; best effort if the peer is gone."""
        out = peer.outgoing.pop(xfer_id, None)
        gen = generation if generation is not None else (out.generation if out else None)
        if gen is None or not peer.alive:
            return
        with contextlib.suppress(KVTransferError):
            await self._send_frame(peer, wire.pack_json(
                Frame.CANCEL, {"xfer": xfer_id, "gen": gen, "reason": reason}))

    async def disconnect(self, peer: Peer) -> None:
        self._fail_peer(peer, PeerUnavailable("disconnected by sender"))
        current = asyncio.current_task()
        tasks = [t for t in peer.tasks if t is not current]
        if stuck := await wire.cancel_all(tasks):
            log.warning("%d task(s) of peer %s:%s did not end on cancel; closing anyway",
                        stuck, peer.address["host"], peer.address["port"])
        await self._on_disconnected(peer)
        peer.notices = None  # its flusher is gone: nothing will send them
        peer.sock.close()
        self._peers.discard(peer)

    async def close(self) -> None:
        for peer in list(self._peers):
            await self.disconnect(peer)
        self._close_memory()
        self.kv = None  # nothing that still refers to this sender keeps the cache alive

    def _pairs(self, src_regions: Sequence[Region], dst_regions: Sequence[Region],
               dst_tp: int) -> tuple[Sequence[tuple[Region, Region]], int]:
        """The (src, dst) region pairs a write moves, coalesced and checked against the
        local cache, and their bytes. ValueError for a region outside it."""
        assert self.kv is not None
        layout = self.kv.layout
        if self.kv.tp == 1 and dst_tp == 1 and isinstance(src_regions, WholeBlocks) \
                and isinstance(dst_regions, WholeBlocks):
            ids = src_regions.ids
            if ids and (min(ids) < 0 or max(ids) >= self.kv.num_blocks):
                self.kv.check(next(Region(b) for b in ids
                                   if not 0 <= b < self.kv.num_blocks))  # raises, naming it
            return rr.BlockPairs.of(ids, dst_regions.ids), len(ids) * layout.block_bytes
        pairs = coalesce(src_regions, dst_regions, layout)
        if self.kv.tp > 1 or dst_tp > 1:  # each rank's heads to the rank(s) taking them
            pairs = rank_pairs(pairs, layout.num_kv_heads, self.kv.tp, dst_tp)
        for src, _ in pairs:
            self.kv.check(src)
        return pairs, sum(self.kv.region_bytes(s) for s, _ in pairs)

    # ----- transport hooks ----------------------------------------------------------
    def _open(self) -> None:
        """Local resources the first connection needs (ucx: its lanes), made before
        the connection's I/O deadlines start."""

    async def _begin(self, peer: Peer, dst_regions: Sequence[Region], xfer_id: str,
                     generation: int) -> None:
        pass

    def _on_revoke(self, peer: Peer, msg: dict[str, Any]) -> None:
        raise ProtocolError(f"{self.name} takes no REVOKE frames")

    def _on_verdict(self, peer: Peer, xfer_id: str, generation: int) -> None:
        pass

    async def _send_regions(self, peer: Peer, pairs: Pairs,
                            xfer_id: str, generation: int, checksum: bool,
                            ready: Ready | None) -> None:
        raise NotImplementedError

    async def _on_connected(self, peer: Peer) -> None:
        pass

    async def _on_disconnected(self, peer: Peer) -> None:
        pass

    def _close_memory(self) -> None:
        pass

    # ----- internals ----------------------------------------------------------------
    def _answered(self, peer: Peer, xfer_id: str, generation: int) -> None:
        """The transfer's verdict will come unasked (no FINISH to send). Marks its entry
        only if it still has one: a cancel or finish that removed it while the frame or
        grant was on its way ended it, and re-creating it would leak it."""
        out = peer.outgoing.get(xfer_id)
        if out is not None and out.generation == generation:
            out.answered = True

    def _outgoing(self, peer: Peer, xfer_id: str, generation: int) -> _Outgoing:
        out = peer.outgoing.get(xfer_id)
        if out is None or out.generation != generation:
            out = _Outgoing(generation, asyncio.get_running_loop().create_future())
            peer.outgoing[xfer_id] = out
        return out

    async def _handshake(self, sock: socket.socket, token: str,
                         layout: KVLayout) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        _, challenge = await wire.expect_json(loop, sock, Frame.CHALLENGE)
        if (mismatch := wire.version_mismatch(challenge.get("version"), "receiver")) is not None:
            raise mismatch
        server_nonce, client_nonce = bytes.fromhex(challenge["nonce"]), wire.nonce()
        await wire.send_all(loop, sock, wire.pack_json(Frame.HELLO, {
            "proof": wire.proof(token, b"c", server_nonce, client_nonce),
            "nonce": client_nonce.hex(), "transport": self.name,
            "layout": json.loads(layout.to_json()), "version": wire.PROTOCOL_VERSION,
            "tp": self.kv.tp if self.kv is not None else 1}))
        kind, reply = await wire.expect_json(loop, sock, Frame.WELCOME, Frame.REFUSE)
        if kind is Frame.REFUSE:
            log.warning("receiver refused us: %s (%s)", reply["kind"], reply["message"])
            raise {"auth": AuthError, "layout": LayoutMismatch, "version": VersionMismatch}.get(
                reply["kind"], ProtocolError)(f"refused by receiver: {reply['message']}")
        want = wire.proof(token, b"s", client_nonce, server_nonce)
        if not wire.hmac.compare_digest(want, str(reply.get("proof", ""))):
            log.warning("receiver failed to prove the shared token; disconnecting")
            raise AuthError("receiver does not hold the cluster token")
        return reply

    async def _send_frame(self, peer: Peer, data: Any) -> None:
        async with peer.send_lock:
            await wire.send_all(asyncio.get_running_loop(), peer.sock, data)

    async def _reader(self, peer: Peer) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                kind, meta, payload_len = await wire.read_frame(loop, peer.sock)
                peer.last_rx = loop.time()
                if payload_len:  # no frame from a receiver carries one
                    raise ProtocolError(f"a {kind.name} frame names a payload of "
                                        f"{payload_len} bytes; it carries none")
                if kind is Frame.RESULT:
                    self._on_result(peer, json.loads(meta))
                elif kind is Frame.GRANT:
                    msg = json.loads(meta)
                    reply = peer.replies.pop(int(msg["req"]), None)
                    if reply is not None and not reply.done():
                        reply.set_result(msg)
                elif kind is Frame.REVOKE:
                    self._on_revoke(peer, json.loads(meta))
                elif kind is Frame.PONG:
                    if peer.pings:
                        peer.vouched = max(peer.vouched, peer.pings.popleft())
                else:
                    raise ProtocolError(f"unexpected {kind.name} frame from the receiver")
        except KVTransferError as e:
            self._fail_peer(peer, e if isinstance(e, PeerUnavailable) else
                            PeerUnavailable(f"receiver connection broken: {e}"))

    def _on_result(self, peer: Peer, msg: dict[str, Any]) -> None:
        self._on_verdict(peer, msg["xfer"], msg["gen"])
        out = peer.outgoing.get(msg["xfer"])
        if out is None or out.generation != msg["gen"] or out.verdict.done():
            return
        if msg["ok"]:
            out.verdict.set_result(None)
        else:
            out.verdict.set_exception(error_from_kind(msg["kind"], msg["message"]))
            out.verdict.exception()

    async def _heartbeat(self, peer: Peer) -> None:
        loop = asyncio.get_running_loop()
        while peer.alive:
            await asyncio.sleep(self.config.heartbeat_s)
            if loop.time() - peer.last_rx > self.config.liveness_timeout_s:
                self._fail_peer(peer, PeerUnavailable(
                    f"receiver silent for {self.config.liveness_timeout_s}s"))
                return
            # After any frame in progress, not instead of it: the answered PING is what
            # extends an in-place grant's window (`Peer.vouched`), busy or not.
            async with peer.send_lock:
                peer.pings.append(time.monotonic())
                try:
                    # (a deadline, not asyncio.wait_for: on Python 3.11 wait_for can
                    # swallow a cancel that lands as its send completes, and this loop
                    # would go on sending PINGs that extend the grants' window)
                    async with wire.deadline(self.config.io_timeout_s):
                        await wire.send_all(loop, peer.sock, wire.pack_frame(Frame.PING))
                except (KVTransferError, TimeoutError) as e:
                    self._fail_peer(peer, PeerUnavailable(f"heartbeat failed: {e!r}"))

    def _fail_peer(self, peer: Peer, error: KVTransferError) -> None:
        """Fail everything pending on `peer` with `error` and close its socket."""
        if peer.error is not None:
            return
        peer.error = error
        log.info("peer %s:%s unusable: %s", peer.address["host"], peer.address["port"], error)
        for out in peer.outgoing.values():
            if not out.verdict.done():
                out.verdict.set_exception(type(error)(str(error)))
                out.verdict.exception()
        for reply in peer.replies.values():
            if not reply.done():
                reply.set_exception(type(error)(str(error)))
                reply.exception()
        # shutdown (not close) wakes every coroutine blocked on the socket with an
        # error; disconnect() closes it once they are gone.
        with contextlib.suppress(OSError):
            peer.sock.shutdown(socket.SHUT_RDWR)

