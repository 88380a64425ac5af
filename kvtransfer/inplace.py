"""One-sided writers: the sender writes straight into the receiver's registered cache
(`shm`: a mapped segment; `cuda_ipc`: an opened CUDA IPC handle; `ucx`: RMA puts).

The bytes land before the receiver can look at them, so fencing needs one round trip
per `write()` call (one chunk of a prefill, however many regions it has):

    sender -> RESERVE {req, xfer, gen, regions}     receiver admits (fence check)
    sender <- GRANT {req, ok, ttl}                  cells claimed, in flight
    sender:   copies every region (`_copy`: the transport's data mover), all done
              before `sent RESERVE + ttl` on its own monotonic clock: the grant was
              issued after that instant, so the bound holds across hosts too
    sender -> WRITE (in place, checksum) per region, one send: the completion notice
                                                    receiver verifies, marks landed

A transfer failed while grants are out resolves once they land or expire (`ttl` +
a margin on the receiver's clock), so a failed transfer's blocks are never written
after its failure is reported (for a sender that honours the grant: peers are
authenticated members of the cluster).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from kvtransfer import wire
from kvtransfer.errors import ProtocolError, TransferTimeout, error_from_kind
from kvtransfer.layout import Region
from kvtransfer.memory import checksum as compute_checksum
from kvtransfer.receiver import Conn, ReceiverBase
from kvtransfer.sender import Peer, SenderBase
from kvtransfer.wire import Frame

_GRANT_MARGIN_S = 0.5  # receiver waits this long past a grant's ttl before reusing cells


@dataclass(slots=True)
class _Grant:
    xfer_id: str
    generation: int
    pending: set[Region]
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class _ConnGrants:
    by_region: dict[tuple[str, int, Region], int] = field(default_factory=dict)
    grants: dict[int, _Grant] = field(default_factory=dict)


class InPlaceReceiver(ReceiverBase):
    """Grants write access to expected cells and lands the senders' in-place WRITEs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._grants: dict[int, _ConnGrants] = {}

    async def _on_reserve(self, conn: Conn, msg: dict[str, Any]) -> None:
        xfer_id, gen = str(msg["xfer"]), int(msg["gen"])
        regions = [Region(*r) for r in msg["regions"]]
        admitted: list[Region] = []
        for region in regions:
            if not self.table.admit(xfer_id, gen, region, conn.id):
                break
            admitted.append(region)
        if len(admitted) < len(regions):
            error = self.table.error_of(xfer_id) or self._results.get((xfer_id, gen))
            kind = error.kind if error is not None else "cancelled"
            for _ in admitted:
                self.table.released(xfer_id, ProtocolError("reservation refused"))
            await self._send(conn, wire.pack_json(Frame.GRANT, {
                "req": msg["req"], "ok": False, "kind": kind,
                "message": f"{xfer_id} gen {gen} is fenced or not expected"}))
            return
        ttl = self.config.io_timeout_s
        book = self._grants.setdefault(conn.id, _ConnGrants())
        grant = _Grant(xfer_id, gen, set(regions))
        grant.timer = asyncio.get_running_loop().call_later(
            ttl + _GRANT_MARGIN_S, self._expire, conn.id, int(msg["req"]))
        book.grants[int(msg["req"])] = grant
        book.by_region.update({(xfer_id, gen, r): int(msg["req"]) for r in regions})
        await self._send(conn, wire.pack_json(Frame.GRANT, {
            "req": msg["req"], "ok": True, "ttl": ttl}))

    async def _on_write(self, conn: Conn, header: wire.WriteHeader, payload_len: int) -> None:
        book = self._grants.get(conn.id)
        key = (header.xfer_id, header.generation, header.region)
        req = None if book is None else book.by_region.pop(key, None)
        if book is None or req is None or payload_len or not header.flags & wire.FLAG_IN_PLACE:
            raise ProtocolError(f"{self.name} write of {header.region} without a grant")
        grant = book.grants[req]
        grant.pending.discard(header.region)
        if not grant.pending:
            self._close_grant(book, req)
        ok = True
        if header.flags & wire.FLAG_CHECKSUM and self.table.is_live(header.xfer_id,
                                                                   header.generation):
            assert self.kv is not None
            ok = self.kv.checksum(header.region) == header.checksum
        self.table.landed(header.xfer_id, header.region, ok)

    def _expire(self, conn_id: int, req: int) -> None:
        book = self._grants.get(conn_id)
        if book is None or req not in book.grants:
            return
        grant = book.grants[req]
        for region in grant.pending:
            book.by_region.pop((grant.xfer_id, grant.generation, region), None)
            self.table.released(grant.xfer_id, TransferTimeout(
                f"{grant.xfer_id}: {self.name} write grant expired"))
        self._close_grant(book, req)

    def _close_grant(self, book: _ConnGrants, req: int) -> None:
        grant = book.grants.pop(req)
        if grant.timer is not None:
            grant.timer.cancel()

    def _on_conn_closed(self, conn: Conn) -> None:
        # Outstanding grants stay until they expire: a sender that lost its
        # connection may still be inside a copy; the grant's ttl bounds that.
        book = self._grants.get(conn.id)
        if book is not None and not book.grants:
            del self._grants[conn.id]

    def _close_memory(self) -> None:
        for book in self._grants.values():
            for grant in book.grants.values():
                if grant.timer is not None:
                    grant.timer.cancel()
        self._grants.clear()


class InPlaceSender(SenderBase):
    """Reserves, copies with the transport's `_copy`, then sends the WRITE notices."""

    async def _send_regions(self, peer: Peer, pairs: list[tuple[Region, Region]],
                            xfer_id: str, generation: int, checksum: bool) -> None:
        assert self.kv is not None
        loop = asyncio.get_running_loop()
        req = secrets.randbits(62)
        reply_future: asyncio.Future[dict[str, Any]] = loop.create_future()
        peer.replies[req] = reply_future
        regions = [[d.block_id, d.layer_start, d.layer_end, d.num_blocks] for _, d in pairs]
        asked = time.monotonic()
        await self._send_frame(peer, wire.pack_json(Frame.RESERVE, {
            "req": req, "xfer": xfer_id, "gen": generation, "regions": regions}))
        grant = await reply_future
        if not grant["ok"]:
            raise error_from_kind(grant["kind"], grant["message"])
        deadline = asked + float(grant["ttl"])
        await self._copy(peer, pairs, deadline)
        if time.monotonic() >= deadline:  # too late to count: the receiver reclaims them
            raise TransferTimeout(f"{xfer_id}: {self.name} copy outlived its grant")
        frames = []
        for src, dst in pairs:
            csum = 0 if not checksum else (self.kv.checksum(src) if self.kv.is_cuda
                                           else compute_checksum(self.kv.view(src)))
            flags = wire.FLAG_IN_PLACE | (wire.FLAG_CHECKSUM if checksum else 0)
            meta = wire.WriteHeader(xfer_id, generation, dst, flags, csum).pack()
            frames.append(wire.pack_frame(Frame.WRITE, meta))
        await self._send_frame(peer, b"".join(frames))

    async def _copy(self, peer: Peer, pairs: list[tuple[Region, Region]],
                    deadline: float) -> None:
        """Write every src region here into its dst region there; return once the
        bytes are in place (visible to the receiver). Start no copy after `deadline`."""
        raise NotImplementedError
