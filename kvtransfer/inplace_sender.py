"""The sending side of the in-place writers' protocol (`kvtransfer/inplace.py`): one
revocable grant per transfer, then per chunk a copy and one WRITTEN notice (in several
frames where its rows exceed one)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtransfer import grants, wire
from kvtransfer import region_rows as rr
from kvtransfer.errors import (
    KVTransferError,
    PeerUnavailable,
    ProtocolError,
    TransferCancelled,
    TransferTimeout,
    error_from_kind,
)
from kvtransfer.layout import KVLayout, Pairs, Region, rank_layout, rank_pairs
from kvtransfer.memory import Ready, producer_event, wait_ready
from kvtransfer.sender import Peer, SenderBase
from kvtransfer.wire import Frame

# rows per RESERVE or WRITTEN frame: 8192 rows pack into 448 KiB of payload, a
# WRITTEN's checksums (one per row, at most 20 digits each) into ~180 KiB of meta:
# each under `wire.MAX_META`
_FRAME_ROWS = 8192


@dataclass(slots=True)
class _Held:
    """A grant as its sender holds it."""

    req: int
    xfer_id: str
    generation: int
    layout: KVLayout  # the receiver's rank caches: what its rows mean
    cells: grants.Cells  # granted, not written yet
    granted: asyncio.Future[None]
    ttl: float = 0.0
    revoked: bool = False
    # peer.vouched when the REVOKE came: the receiver's bound no longer moves with PINGs
    # after it, so the sender's stops moving too
    vouched_at_revoke: float | None = None
    settled: bool = False  # the transfer's verdict came
    inflight: int = 0  # writes past taking their cells, notice not sent (nor dropped)
    asking: asyncio.Lock = field(default_factory=asyncio.Lock)  # a RESERVE in flight


class InPlaceSender(SenderBase):
    """Holds one grant per transfer (asked for by `begin`; a write into cells it does
    not hold extends it first, by one more RESERVE round trip), copies with the
    transport's `_copy` and sends one WRITTEN notice per write (several frames where
    its rows exceed one: `_written`).

    A copy still running on the device when `_copy` returns (cuda_ipc: an event after
    the chunk's launch) defers its notice: `write()` returns at once and the notice goes
    out when the event completed, so no chunk waits on the host for the one before.
    The copies of one sender run in order on one stream: the flusher waits on the
    newest pending event only and then sends every notice whose event completed."""

    async def _begin(self, peer: Peer, dst_regions: Sequence[Region], xfer_id: str,
                     generation: int) -> None:
        assert self.kv is not None
        dst_tp = int(peer.welcome.get("tp", 1))
        there = rank_layout(self.kv.layout, dst_tp)
        dst = dst_regions
        if self.kv.tp > 1 or dst_tp > 1:  # the cells each rank's heads go to
            dst = [d for _, d in rank_pairs([(d, d) for d in dst_regions],
                                            self.kv.layout.num_kv_heads, self.kv.tp, dst_tp)]
        await self._grant(peer, rr.rows_of(dst, there), there, xfer_id, generation)

    async def _grant(self, peer: Peer, rows: np.ndarray, there: KVLayout, xfer_id: str,
                     generation: int) -> _Held:
        """The transfer's grant, holding the cells of `rows` (RESERVEd here where it does
        not yet: the first call asks for the grant, a later one extends it); returns it
        once GRANTed. Raises the receiver's typed error if it refuses."""
        want = grants.cells_of(rows, there)
        if want is None:
            raise await self._give_up(peer, xfer_id, generation, "destination regions overlap")
        key = (xfer_id, generation)
        found: _Held | None = peer.grants.get(key)
        first = found is None
        if found is not None:
            held = found
        else:
            held = _Held(secrets.randbits(62), xfer_id, generation, there, {},
                         asyncio.get_running_loop().create_future())
            peer.grants[key] = held
        async with held.asking:  # one RESERVE at a time per grant (one req, one reply)
            if not first:
                await asyncio.shield(held.granted)  # raises the first one's refusal
                if held.revoked:
                    raise TransferCancelled(f"{xfer_id}: the receiver revoked its grant")
                if grants.covers(held.cells, want):
                    return held
                # only the blocks' cells it does not hold yet
                rows = rr.one_per_block(rows)
                rows = rows[[not grants.covers(held.cells, grants.cells_of(r[None], there)
                                               or {}) for r in rows]]
                want = grants.cells_of(rows, there) or {}
            try:
                for part in _parts(rr.coalesce_rows(rows, there)):
                    await self._reserve(peer, held, part)
            except BaseException as e:
                if first:
                    if peer.grants.get(key) is held:
                        del peer.grants[key]
                    if isinstance(e, KVTransferError):
                        held.granted.set_exception(type(e)(str(e)))
                        held.granted.exception()
                    else:
                        held.granted.cancel()
                raise
            grants.add(held.cells, want)
            # granted: we are a writer of the transfer, whose verdict comes to us unasked
            self._answered(peer, xfer_id, generation)
            if first:
                held.granted.set_result(None)
        return held

    async def _give_up(self, peer: Peer, xfer_id: str, generation: int,
                       why: str) -> ProtocolError:
        """A write that cannot be granted: the receiver fences the transfer (CANCEL)
        rather than waiting for its lease; returns the error to raise."""
        await self.cancel(peer, xfer_id, generation, why)
        return ProtocolError(f"{xfer_id}: {why}")

    async def _reserve(self, peer: Peer, held: _Held, rows: np.ndarray) -> None:
        """One RESERVE of `rows` for `held`; returns once GRANTed."""
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        peer.replies[held.req] = reply
        asked = time.monotonic()
        try:
            await self._send_frame(peer, wire.pack_json(Frame.RESERVE, {
                "req": held.req, "xfer": held.xfer_id, "gen": held.generation},
                rr.pack_rows(rows)))
            grant = await reply
        finally:
            peer.replies.pop(held.req, None)
        if not grant["ok"]:
            raise error_from_kind(grant["kind"], grant["message"])
        held.ttl = float(grant["ttl"])
        peer.vouched = max(peer.vouched, asked)

    async def _send_regions(self, peer: Peer, pairs: Pairs,
                            xfer_id: str, generation: int, checksum: bool,
                            ready: Ready | None) -> None:
        assert self.kv is not None
        held = peer.grants.get((xfer_id, generation))
        if held is not None:
            await asyncio.shield(held.granted)
        if held is not None and held.revoked:
            raise TransferCancelled(f"{xfer_id}: the receiver revoked its write grant")
        there = held.layout if held is not None else \
            rank_layout(self.kv.layout, int(peer.welcome.get("tp", 1)))
        rows = rr.side_rows(pairs, "dst", there)
        if held is None or not grants.take(held.cells, rows, there):
            # cells not begun (no begin(), or a write outside it): the grant extends
            held = await self._grant(peer, rows, there, xfer_id, generation)
            if not grants.take(held.cells, rows, there):
                raise await self._give_up(peer, xfer_id, generation, "regions written before")
            if held.revoked:
                raise TransferCancelled(f"{xfer_id}: the receiver revoked its write grant")
        held.inflight += 1
        deferred = False
        copied: Ready | None = None
        try:
            copied = await self._copy(peer, pairs, peer.vouched + held.ttl, ready)
            sums = None if not checksum else await self._checksums(pairs, ready)
            notice = _written(held.req, rows, sums)
            if copied is not None:
                if not copied.query():
                    self._defer(peer, _Notice(copied, held, notice))
                    deferred = True
                    return
                copied.synchronize()  # done: raises what the copy raised
            # past it the receiver may reuse them
            if time.monotonic() >= _reuse_bound(peer, held, self.config.copy_budget_s):
                raise TransferTimeout(f"{xfer_id}: {self.name} copy outlived its grant")
            await self._send_frame(peer, notice)
        except PeerUnavailable as e:
            # a copy that faulted on the peer's memory (on this loop, or done on its
            # thread) fails the peer as `_flush` does for one it waited for
            self._fail_peer(peer, e)
            raise
        finally:
            if deferred:
                pass
            elif copied is not None and not copied.query():  # failed with its copy running:
                self._defer(peer, _Notice(copied, held, None))  # over once the copy is
            else:
                self._ended(peer, held)

    def _ended(self, peer: Peer, held: _Held) -> None:
        """A write of `held` is over (its notice sent, or it failed with its copy
        stopped: `_copy`'s contract). A revoked grant is answered once none is left."""
        held.inflight -= 1
        if held.inflight:
            return
        if held.revoked:
            self._answer(peer, held.req)
        if held.revoked or held.settled:
            self._drop(peer, held)

    def _on_revoke(self, peer: Peer, msg: dict[str, Any]) -> None:
        xfer_id, gen, req = str(msg["xfer"]), int(msg["gen"]), int(msg["req"])
        out = peer.outgoing.get(xfer_id)
        if out is not None and out.generation == gen and not out.verdict.done():
            out.verdict.set_exception(error_from_kind(str(msg["kind"]), str(msg["message"])))
            out.verdict.exception()
        held = peer.grants.get((xfer_id, gen))
        if held is None or held.req != req:  # asked for and given up: nothing written
            self._answer(peer, req)
            return
        held.revoked = True  # no copy starts from now on
        held.vouched_at_revoke = peer.vouched
        if not held.inflight:
            self._answer(peer, req)
            self._drop(peer, held)

    def _on_verdict(self, peer: Peer, xfer_id: str, generation: int) -> None:
        held = peer.grants.get((xfer_id, generation))
        if held is not None:
            held.settled = True
            if not held.inflight:
                self._drop(peer, held)

    @staticmethod
    def _drop(peer: Peer, held: _Held) -> None:
        if peer.grants.get((held.xfer_id, held.generation)) is held:
            del peer.grants[(held.xfer_id, held.generation)]

    def _answer(self, peer: Peer, req: int) -> None:
        if not peer.alive:  # the receiver waits out the grant's bound instead
            return
        task = asyncio.get_running_loop().create_task(self._send_quietly(
            peer, wire.pack_json(Frame.REVOKED, {"req": req})))
        peer.tasks = [t for t in peer.tasks if not t.done()] + [task]

    async def _send_quietly(self, peer: Peer, data: bytes) -> None:
        try:
            await asyncio.wait_for(self._send_frame(peer, data), self.config.io_timeout_s)
        except (KVTransferError, asyncio.TimeoutError) as e:
            self._fail_peer(peer, TransferTimeout(f"REVOKED not sent: {e!r}"))

    def _defer(self, peer: Peer, notice: _Notice) -> None:
        if peer.notices is None:
            peer.notices = _Notices()
        pending: _Notices = peer.notices
        pending.queue.append(notice)
        if pending.task is None or pending.task.done():
            pending.task = asyncio.get_running_loop().create_task(self._flush(peer, pending))
            # `disconnect` cancels the flusher with the peer's other tasks
            peer.tasks = [t for t in peer.tasks if not t.done()] + [pending.task]

    async def _flush(self, peer: Peer, pending: _Notices) -> None:
        """Send the deferred notices as their copies complete, in order. A copy that
        completed past its grant fails its transfer instead (the receiver may reuse
        the cells); one that failed fails the peer."""
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
                    try:
                        n.copied.synchronize()  # done: raises what the copy raised
                        if n.frame is None:
                            pass  # its write failed: nothing to tell, only to wait for
                        elif time.monotonic() >= _reuse_bound(peer, n.held,
                                                              self.config.copy_budget_s):
                            self._late(peer, n.held)
                        else:
                            await self._send_frame(peer, n.frame)
                    finally:
                        self._ended(peer, n.held)
        except KVTransferError as e:
            pending.queue.clear()
            self._fail_peer(peer, e)  # fails every transfer still pending on the peer
        finally:
            if not pending.queue and peer.notices is pending:
                peer.notices = None

    def _late(self, peer: Peer, held: _Held) -> None:
        """`held`'s copy completed past its bound: its transfer fails (not a later one
        that reuses the id: its generation tells them apart)."""
        out = peer.outgoing.get(held.xfer_id)
        if out is not None and out.generation == held.generation and not out.verdict.done():
            out.verdict.set_exception(TransferTimeout(
                f"{held.xfer_id}: {self.name} copy outlived its grant"))
            out.verdict.exception()

    async def _checksums(self, pairs: Pairs,
                         ready: Ready | None) -> list[int]:
        assert self.kv is not None
        if not self.kv.is_cuda:
            return [self.kv.checksum(src) for src, _ in pairs]
        # Read after `ready`, in a worker thread: not behind (nor blocking the event loop
        # on) the compute queued after the chunk.
        after = producer_event(self.kv.tensor.device, ready)
        return await asyncio.to_thread(self.kv.device_checksums, [s for s, _ in pairs], after)

    async def _copy(self, peer: Peer, pairs: Pairs,
                    deadline: float, ready: Ready | None) -> Ready | None:
        """Write every src region here into its dst region there, none before `ready`
        completed, none started after `deadline`, every one over (done, or stopped)
        within `config.copy_budget_s` after it. Returns None once the bytes are in
        place (visible to the receiver), or an event that completes when they are;
        returns or raises (cancelled too) only once nothing else it started still
        writes: a revoked grant is answered then."""
        raise NotImplementedError


def _parts(rows: np.ndarray) -> list[np.ndarray]:
    """`rows` in RESERVE or WRITTEN frames a receiver reads (`wire.MAX_META`)."""
    return [rows[i:i + _FRAME_ROWS] for i in range(0, max(len(rows), 1), _FRAME_ROWS)]


def _written(req: int, rows: np.ndarray, sums: list[int] | None) -> bytes:
    """The WRITTEN notice of a write of `rows` into grant `req`: one frame per part
    (`_parts`), each with its rows' checksums, sent together. The receiver takes each
    part's cells out of the grant as it comes (the grant's last cells end it)."""
    frames, at = [], 0
    for part in _parts(rows):
        frames.append(wire.pack_json(Frame.WRITTEN, {
            "req": req, "checksums": None if sums is None else sums[at:at + len(part)]},
            rr.pack_rows(part)))
        at += len(part)
    return b"".join(frames)


def _reuse_bound(peer: Peer, held: _Held, copy_budget_s: float) -> float:
    """Past this the receiver may reuse the grant's cells (`TransferConfig.copy_budget_s`):
    the window PINGs keep moving, frozen once the grant is revoked (the receiver counts
    its bound from the last frame before its REVOKE, which is no earlier)."""
    vouched = peer.vouched if held.vouched_at_revoke is None else held.vouched_at_revoke
    return vouched + held.ttl + copy_budget_s


@dataclass(slots=True)
class _Notice:
    copied: Ready
    held: _Held
    frame: bytes | None  # None: the write failed; its grant waits for the copy only


@dataclass(slots=True)
class _Notices:
    queue: deque[_Notice] = field(default_factory=deque)
    task: asyncio.Task[None] | None = None
