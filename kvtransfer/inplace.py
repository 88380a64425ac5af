"""One-sided writers: the sender writes straight into the receiver's registered cache
(`shm`: a mapped segment; `cuda_ipc`: an opened CUDA IPC handle; `ucx`: RMA puts).

The bytes land before the receiver can look at them, so the receiver fences a
transfer's cells before any write: the sender holds ONE revocable grant per transfer,
asked for once, as soon as it knows the destination (`begin`: when the prefill call
arrives, its round trip overlapped with the compute), and held until the transfer ends:

    sender -> RESERVE {req, xfer, gen} + regions    every destination cell of the
                                                    transfer (coalesced; in several
                                                    frames of one req if too many);
                                                    receiver admits (fence check), all
                                                    claimed as one write
    sender <- GRANT {req, ok, ttl}                  in flight until the grant ends
    per chunk, no waiting:
    sender:   copies the chunk's regions (its cells taken out of the grant first:
              nowhere ungranted, nothing twice)
    sender -> WRITTEN {req, checksums} + regions    receiver takes the same cells out of
                                                    the grant, verifies, marks landed;
                                                    the last one ends the grant
    sender <- RESULT {xfer, gen, ok}                once the transfer resolved: to every
                                                    writer unasked
    when the transfer fails (lease, cancel, fence, bad write) with the grant out:
    sender <- REVOKE {req, xfer, gen, kind}         the sender starts no more copies
    sender -> REVOKED {req}                         once none of its copies is in flight;
                                                    then the receiver reuses the cells

A sender that does not answer (hung, gone) is bounded by time: a grant holds only
`ttl` past the send of the newest request the receiver answered (RESERVE, or a
heartbeat PING): the sender starts no copy past that on its own clock, and every copy
it started is over within `TransferConfig.copy_budget_s` after it; so the receiver
reuses a revoked grant's cells `ttl` + that budget + a margin after the last frame it
got on that connection, whether or not the REVOKE arrived. Hence a failed transfer's
blocks are never written after its failure is reported (for a sender that honours the
grant: peers are authenticated members of the cluster).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from kvtransfer import grants, wire
from kvtransfer import region_rows as rr
from kvtransfer.errors import KVTransferError, ProtocolError, TransferTimeout
from kvtransfer.receiver import Conn, ReceiverBase
from kvtransfer.wire import Frame

log = logging.getLogger(__name__)
_GRANT_MARGIN_S = 0.5  # past a revoked grant's bound and copy budget, before reuse


@dataclass(slots=True)
class _Grant:
    conn: Conn
    req: int
    xfer_id: str
    generation: int
    cells: grants.Cells  # granted, not landed yet
    revoked: bool = False
    timer: asyncio.TimerHandle | None = None


class InPlaceReceiver(ReceiverBase):
    """Grants write access to a transfer's cells, lands the senders' in-place writes
    and revokes the grants of transfers that fail."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._grants: dict[tuple[int, int], _Grant] = {}  # (conn id, req) -> grant
        self._of_xfer: dict[str, set[tuple[int, int]]] = {}  # xfer id -> its grants

    async def _on_reserve(self, conn: Conn, msg: dict[str, Any],
                          packed: bytes | bytearray) -> None:
        xfer_id, gen, req = str(msg["xfer"]), int(msg["gen"]), int(msg["req"])
        try:
            rows = rr.rows_from_wire(packed)
        except ValueError as e:
            raise ProtocolError(f"{self.name} RESERVE with malformed regions: {e}") from None
        grant = self._grants.get((conn.id, req))
        if grant is None and any(k[0] == conn.id and self._grants[k].generation == gen
                                 for k in self._of_xfer.get(xfer_id, ())):
            # a second grant of one transfer to one sender (a begin retried after its
            # timeout): what was written under the first cannot be told apart
            self.table.fail(xfer_id, ProtocolError(f"{xfer_id} granted twice to a sender"))
            await self._refuse(conn, req, "protocol", f"{xfer_id} is already granted")
            return
        if grant is not None and (grant.xfer_id, grant.generation) != (xfer_id, gen):
            await self._refuse(conn, req, "protocol", f"grant {req} is of {grant.xfer_id}")
            return
        # every cell of the transfer (a RESERVE of the same req extends the grant: one
        # too large for a frame, a write outside the cells begun): one write in flight
        # until the grant ends
        slices = None if grant is not None and grant.revoked else self.table.admit_rows(
            xfer_id, gen, rows, conn.id, extend=grant is not None)
        if slices is None:
            error = self.table.error_of(xfer_id) or self._results.get((xfer_id, gen))
            await self._refuse(conn, req, error.kind if error is not None else "cancelled",
                               f"{xfer_id} gen {gen} is fenced or not expected")
            return
        cells = grants.cells_of_slices(slices, self.table.layout)
        assert cells is not None  # admit_rows refuses cells claimed twice
        if grant is None:
            self._grants[(conn.id, req)] = _Grant(conn, req, xfer_id, gen, cells)
            self._of_xfer.setdefault(xfer_id, set()).add((conn.id, req))
        else:
            grants.add(grant.cells, cells)
        await self._send(conn, wire.pack_json(Frame.GRANT, {
            "req": req, "ok": True, "ttl": self.config.io_timeout_s}))

    async def _refuse(self, conn: Conn, req: int, kind: str, message: str) -> None:
        await self._send(conn, wire.pack_json(Frame.GRANT, {
            "req": req, "ok": False, "kind": kind, "message": message}))

    async def _on_written(self, conn: Conn, msg: dict[str, Any],
                          packed: bytes | bytearray) -> None:
        grant = self._grants.get((conn.id, int(msg["req"])))
        if grant is None or grant.revoked:
            # a copy that was in flight when its grant was revoked: its bytes landed in
            # cells no one reads before the REVOKED (or the bound) lets them go
            self.metrics.stale_dropped.inc()
            log.info("dropped a write into revoked grant %s of %s", msg["req"],
                     grant.xfer_id if grant else "?")
            return
        try:
            rows = rr.rows_from_wire(packed)
            checksums: list[int] = msg.get("checksums") or []
            if not len(rows):
                raise ProtocolError("WRITTEN names no regions")
            slices = rr.checked_slices(rows, self.table.layout, self.table.num_blocks,
                                       self.table.tp)
            if checksums and len(checksums) != len(rows):
                raise ProtocolError("WRITTEN carries a checksum per region or none")
        except (ValueError, ProtocolError) as e:
            self.table.fail(grant.xfer_id, e if isinstance(e, ProtocolError) else
                            ProtocolError(f"{grant.xfer_id}: WRITTEN: {e}"))
            raise ProtocolError(f"{self.name} malformed WRITTEN: {e}") from None
        taken = grants.take_slices(grant.cells, slices, self.table.layout)
        if taken is None:
            # bytes outside the grant or written twice: dropped, the transfer fails
            self.metrics.stale_dropped.inc()
            self.table.fail(grant.xfer_id, ProtocolError(
                f"{grant.xfer_id}: a write outside its grant, or written twice"))
            return
        bad = None
        if checksums:
            assert self.kv is not None
            regions = rr.to_regions(rows, self.table.layout)
            bad = next((i for i, r in enumerate(regions)
                        if self.kv.checksum(r) != checksums[i]), None)
        ends = not grant.cells
        if ends:
            self._forget(grant)
        self.table.landed_rows(grant.xfer_id, rows, bad, ends=ends, cells=taken)

    def _on_abort(self, xfer_id: str, writers: set[int]) -> None:
        for key in list(self._of_xfer.get(xfer_id, ())):
            grant = self._grants[key]
            if not grant.revoked:
                grant.revoked = True
                self._spawn(self._revoke(grant))

    async def _revoke(self, grant: _Grant) -> None:
        """Sends REVOKE (within io_timeout_s, the wait for the connection included), then
        bounds the wait for REVOKED: the sender copies nothing past `ttl` after the newest
        request we answered, all received by now. A REVOKE not sent drops the connection:
        no frame extends the sender's window past it. Either way the cells are let go at
        most io_timeout_s + ttl + the copy budget + the margin after the failure."""
        error = self.table.error_of(grant.xfer_id)
        conn = grant.conn
        if conn.id in self._conns:
            try:
                await asyncio.wait_for(self._send(conn, wire.pack_json(Frame.REVOKE, {
                    "req": grant.req, "xfer": grant.xfer_id, "gen": grant.generation,
                    "kind": error.kind if error else "cancelled",
                    "message": str(error) if error else "revoked"})), self.config.io_timeout_s)
            except (KVTransferError, OSError, TimeoutError) as e:
                log.warning("%s: REVOKE of %s not sent (%r); dropping the connection",
                            self.name, grant.xfer_id, e)
                if conn.task is not None:
                    conn.task.cancel()
        if (conn.id, grant.req) in self._grants:  # not answered meanwhile
            loop = asyncio.get_running_loop()
            bound = conn.last_rx + self.config.io_timeout_s + self.config.copy_budget_s \
                + _GRANT_MARGIN_S
            grant.timer = loop.call_at(bound, self._expire, grant)

    def _on_revoked(self, conn: Conn, msg: dict[str, Any]) -> None:
        grant = self._grants.get((conn.id, int(msg["req"])))
        if grant is None:  # let go already, at its bound
            return
        if not grant.revoked:
            raise ProtocolError(f"{self.name} REVOKED for a grant that was not revoked")
        self._release(grant, "revoked")

    def _expire(self, grant: _Grant) -> None:
        if (grant.conn.id, grant.req) in self._grants:
            log.warning("%s: grant %d of %s not given back in time; its cells reused",
                        self.name, grant.req, grant.xfer_id)
            self._release(grant, "its revoked write grant was not given back in time")

    def _release(self, grant: _Grant, why: str) -> None:
        """The grant's writes are over (answered, or past its bound): the transfer
        (failed) resolves once no other write into it is in flight."""
        self._forget(grant)
        self.table.released(grant.xfer_id, TransferTimeout(f"{grant.xfer_id}: {why}"))

    def _forget(self, grant: _Grant) -> None:
        if grant.timer is not None:
            grant.timer.cancel()
        del self._grants[(grant.conn.id, grant.req)]
        keys = self._of_xfer[grant.xfer_id]
        keys.discard((grant.conn.id, grant.req))
        if not keys:
            del self._of_xfer[grant.xfer_id]

    def _close_memory(self) -> None:
        # closing: the cache goes away, every transfer is failed and resolves now
        for grant in list(self._grants.values()):
            self._release(grant, "receiver closed")
