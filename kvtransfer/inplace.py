"""One-sided writers: the sender writes straight into the receiver's registered cache
(`shm`: a mapped segment; `cuda_ipc`: an opened CUDA IPC handle; `ucx`: RMA puts).

The bytes land before the receiver can look at them, so fencing needs one round trip
per `write()` call (one chunk of a prefill, however many regions it has):

    sender -> RESERVE {req, xfer, gen, regions}     receiver admits (fence check)
    sender <- GRANT {req, ok, ttl}                  cells claimed, in flight
    sender:   copies every region (`_copy`: the transport's data mover), all done
              before `sent RESERVE + ttl` on its own monotonic clock: the grant was
              issued after that instant, so the bound holds across hosts too
    sender -> WRITTEN {req, checksums}              ONE completion notice per chunk:
                                                    receiver verifies, marks landed
    sender <- RESULT {xfer, gen, ok}                once the transfer resolved: to every
                                                    writer unasked (`finish` sends no
                                                    FINISH after a grant)

A transfer failed while grants are out resolves once they land or expire (`ttl` +
a margin on the receiver's clock), so a failed transfer's blocks are never written
after its failure is reported (for a sender that honours the grant: peers are
authenticated members of the cluster).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtransfer import region_rows as rr
from kvtransfer import wire
from kvtransfer.errors import KVTransferError, ProtocolError, TransferTimeout, error_from_kind
from kvtransfer.layout import Region
from kvtransfer.memory import Ready, producer_event, wait_ready
from kvtransfer.receiver import Conn, ReceiverBase
from kvtransfer.sender import Peer, SenderBase
from kvtransfer.wire import Frame

_GRANT_MARGIN_S = 0.5  # receiver waits this long past a grant's ttl before reusing cells


@dataclass(slots=True)
class _Grant:
    xfer_id: str
    generation: int
    rows: np.ndarray  # the chunk's regions (`region_rows`), admitted as one write
    timer: asyncio.TimerHandle | None = None


class InPlaceReceiver(ReceiverBase):
    """Grants write access to expected cells and lands the senders' in-place writes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._grants: dict[int, dict[int, _Grant]] = {}  # conn id -> req -> grant

    async def _on_reserve(self, conn: Conn, msg: dict[str, Any]) -> None:
        xfer_id, gen, req = str(msg["xfer"]), int(msg["gen"]), int(msg["req"])
        try:
            rows = rr.rows_from_wire(msg["regions"], self.table.layout)
        except ValueError as e:
            raise ProtocolError(f"{self.name} RESERVE with malformed regions: {e}") from None
        book = self._grants.setdefault(conn.id, {})
        if req in book:
            raise ProtocolError(f"{self.name} reservation {req} is already granted")
        # every region of the chunk at once (one write in flight until WRITTEN)
        if not self.table.admit_rows(xfer_id, gen, rows, conn.id):
            error = self.table.error_of(xfer_id) or self._results.get((xfer_id, gen))
            kind = error.kind if error is not None else "cancelled"
            await self._send(conn, wire.pack_json(Frame.GRANT, {
                "req": req, "ok": False, "kind": kind,
                "message": f"{xfer_id} gen {gen} is fenced or not expected"}))
            return
        ttl = self.config.io_timeout_s
        book[req] = _Grant(xfer_id, gen, rows, asyncio.get_running_loop().call_later(
            ttl + _GRANT_MARGIN_S, self._expire, conn.id, req))
        await self._send(conn, wire.pack_json(Frame.GRANT, {"req": req, "ok": True,
                                                            "ttl": ttl}))

    async def _on_written(self, conn: Conn, msg: dict[str, Any]) -> None:
        grant = self._grants.get(conn.id, {}).pop(int(msg["req"]), None)
        if grant is None:
            raise ProtocolError(f"{self.name} WRITTEN without a grant")
        if grant.timer is not None:
            grant.timer.cancel()
        try:
            checksums: list[int] = msg.get("checksums") or []
            if checksums and len(checksums) != len(grant.rows):
                raise ProtocolError("WRITTEN carries a checksum per region or none")
            bad = None
            if checksums and self.table.is_live(grant.xfer_id, grant.generation):
                assert self.kv is not None
                regions = rr.to_regions(grant.rows, self.table.layout)
                bad = next((i for i, r in enumerate(regions)
                            if self.kv.checksum(r) != checksums[i]), None)
        except Exception as e:  # the write in flight ends with its transfer failed
            self.table.released(grant.xfer_id, e if isinstance(e, ProtocolError)
                                else ProtocolError(f"{grant.xfer_id}: WRITTEN: {e!r}"))
            raise
        self.table.landed_rows(grant.xfer_id, grant.rows, bad)

    def _expire(self, conn_id: int, req: int) -> None:
        grant = self._grants.get(conn_id, {}).pop(req, None)
        if grant is None:
            return
        self.table.released(grant.xfer_id, TransferTimeout(
            f"{grant.xfer_id}: {self.name} write grant expired"))

    def _on_conn_closed(self, conn: Conn) -> None:
        # Outstanding grants stay until they expire: a sender that lost its
        # connection may still be inside a copy; the grant's ttl bounds that.
        if not self._grants.get(conn.id, True):
            del self._grants[conn.id]

    def _close_memory(self) -> None:
        for book in self._grants.values():
            for grant in book.values():
                if grant.timer is not None:
                    grant.timer.cancel()
        self._grants.clear()


class InPlaceSender(SenderBase):
    """Reserves, copies with the transport's `_copy`, then sends one WRITTEN notice.

    A copy still running on the device when `_copy` returns (cuda_ipc: an event after
    the chunk's launch) defers its notice: `write()` returns at once and the notice goes
    out when the event completed, so no chunk waits on the host for the one before.
    The copies of one sender run in order on one stream: the flusher waits on the
    newest pending event only and then sends every notice whose event completed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._notices: dict[int, _Notices] = {}  # id(peer) -> notices waiting for copies

    async def _send_regions(self, peer: Peer, pairs: list[tuple[Region, Region]],
                            xfer_id: str, generation: int, checksum: bool,
                            ready: Ready | None) -> None:
        assert self.kv is not None
        loop = asyncio.get_running_loop()
        req = secrets.randbits(62)
        reply_future: asyncio.Future[dict[str, Any]] = loop.create_future()
        peer.replies[req] = reply_future
        regions = [[d.block_id, d.layer_start, d.layer_end, d.num_blocks, d.rank, d.head_start,
                    d.head_end] for _, d in pairs]
        asked = time.monotonic()
        await self._send_frame(peer, wire.pack_json(Frame.RESERVE, {
            "req": req, "xfer": xfer_id, "gen": generation, "regions": regions}))
        grant = await reply_future
        if not grant["ok"]:
            raise error_from_kind(grant["kind"], grant["message"])
        # granted: we are a writer of the transfer, whose verdict comes to us unasked
        self._outgoing(peer, xfer_id, generation).answered = True
        deadline = asked + float(grant["ttl"])
        copied = await self._copy(peer, pairs, deadline, ready)
        sums = None if not checksum else await self._checksums(pairs, ready)
        notice = wire.pack_json(Frame.WRITTEN, {"req": req, "checksums": sums})
        if copied is not None:
            if not copied.query():
                self._defer(peer, _Notice(copied, deadline, xfer_id, notice))
                return
            copied.synchronize()  # done: raises what the copy raised
        if time.monotonic() >= deadline:  # too late to count: the receiver reclaims them
            raise TransferTimeout(f"{xfer_id}: {self.name} copy outlived its grant")
        await self._send_frame(peer, notice)

    def _defer(self, peer: Peer, notice: _Notice) -> None:
        pending = self._notices.setdefault(id(peer), _Notices())
        pending.queue.append(notice)
        if pending.task is None or pending.task.done():
            pending.task = asyncio.get_running_loop().create_task(self._flush(peer, pending))
            # `disconnect` cancels the flusher with the peer's other tasks
            peer.tasks = [t for t in peer.tasks if not t.done()] + [pending.task]

    async def _flush(self, peer: Peer, pending: _Notices) -> None:
        """Send the deferred notices as their copies complete, in order. A copy that
        completed past its grant fails its transfer instead (the receiver reclaims the
        cells); one that failed fails the peer."""
        try:
            while pending.queue:
                # The newest covers every copy before it on one stream; where it is done
                # and the oldest is not (copies in threads), wait for the oldest.
                wait = pending.queue[-1].copied
                if wait.query():
                    wait = pending.queue[0].copied
                if not wait.query():
                    await wait_ready(wait)
                while pending.queue and pending.queue[0].copied.query():
                    n = pending.queue.popleft()
                    n.copied.synchronize()  # done: raises what the copy raised
                    if time.monotonic() >= n.deadline:
                        self._late(peer, n.xfer_id)
                    else:
                        await self._send_frame(peer, n.frame)
        except KVTransferError as e:
            pending.queue.clear()
            self._fail_peer(peer, e)  # fails every transfer still pending on the peer
        finally:
            if not pending.queue:
                self._notices.pop(id(peer), None)

    def _late(self, peer: Peer, xfer_id: str) -> None:
        out = peer.outgoing.get(xfer_id)
        if out is not None and not out.verdict.done():
            out.verdict.set_exception(TransferTimeout(
                f"{xfer_id}: {self.name} copy outlived its grant"))
            out.verdict.exception()

    async def _checksums(self, pairs: list[tuple[Region, Region]],
                         ready: Ready | None) -> list[int]:
        assert self.kv is not None
        if not self.kv.is_cuda:
            return [self.kv.checksum(src) for src, _ in pairs]
        # Read after `ready`, in a worker thread: not behind (nor blocking the event loop
        # on) the compute queued after the chunk.
        after = producer_event(self.kv.tensor.device, ready)
        return await asyncio.to_thread(self.kv.device_checksums, [s for s, _ in pairs], after)

    async def _copy(self, peer: Peer, pairs: list[tuple[Region, Region]],
                    deadline: float, ready: Ready | None) -> Ready | None:
        """Write every src region here into its dst region there, none before `ready`
        completed, none started after `deadline`. Returns None once the bytes are in
        place (visible to the receiver), or an event that completes when they are."""
        raise NotImplementedError


@dataclass(slots=True)
class _Notice:
    copied: Ready
    deadline: float
    xfer_id: str
    frame: bytes


@dataclass(slots=True)
class _Notices:
    queue: deque[_Notice] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None
