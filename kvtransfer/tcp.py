"""`tcp`: KV bytes follow each WRITE frame's header on the control stream itself.

The reference and fallback transport. A `write()` goes as one WRITE frame per chunk
(`tcp_frames`: a bounded batch of regions as rows of one int64 array, then their
bytes). The receiver admits the frame's whole row table before a byte lands, then
reads the payload with `sock_recv_into` straight into the destination blocks, one
call per run of adjacent blocks; if the transfer is fenced mid-frame, the rest of the
payload goes to a scratch buffer instead, so no byte of a stale write lands after the
fence. A table that fails its checks lands nothing: a stale one is dropped (counted)
and one the transfer does not expect fails it, their payload discarded; one whose
payload is not the rows' total ends the connection.

Every WRITE frame is answered with the transfer's RESULT, unasked: one admitted makes
its sender a writer of the transfer, told its verdict; one dropped is answered as a
FINISH is (the verdict, at once if known, else once the transfer resolves). So a
sender that wrote sends no FINISH: its verdict is on its way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from itertools import chain

import numpy as np
import xxhash
from prometheus_client import CollectorRegistry

from kvtransfer import region_rows as rr
from kvtransfer import wire
from kvtransfer.config import TransferConfig
from kvtransfer.copy_kernel import staged_regions
from kvtransfer.errors import KVTransferError, PeerUnavailable, ProtocolError
from kvtransfer.faults import Faults, on_wire
from kvtransfer.layout import Pairs, Region, rank_layout
from kvtransfer.memory import Ready, block_parts, host_bytes, wait_ready
from kvtransfer.memory import checksum as compute_checksum
from kvtransfer.receiver import Conn, ReceiverBase
from kvtransfer.sender import Peer, SenderBase
from kvtransfer.tcp_frames import WriteHead, batches, row_checksums, runs
from kvtransfer.wire import Frame

_SCRATCH_BYTES = 1 << 20
# A head slice's packed runs are received (and sent) this many bytes of whole blocks
# at a time, and laid into the rank's cache while they are still in the CPU's cache
_SLICE_PART_BYTES = 4 << 20


class TcpReceiver(ReceiverBase):
    name = "tcp"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))

    async def _on_write(self, conn: Conn, meta: bytes, payload_len: int) -> None:
        head = WriteHead.unpack(meta)
        xfer_id, rows = head.xfer_id, head.rows
        # every row at once, all or none: live, its generation, in bounds, cells expected
        # and unclaimed (a stale table is counted, an unexpected one fails the transfer)
        if self.table.admit_rows(xfer_id, head.generation, rows, conn.id) is None:
            await self._discard(conn, payload_len)
            # not a writer of it: the sender, which sends no FINISH, is told the verdict
            await self._on_finish(conn, {"xfer": xfer_id, "gen": head.generation})
            return
        try:
            sizes = rr.nbytes(rows, self.table.layout)
            if payload_len != (total := int(sizes.sum())):
                raise ProtocolError(f"{xfer_id}: a WRITE payload of {payload_len} bytes for "
                                    f"rows of {total}")
            digests = await self._land_rows(conn, head, sizes, total)
        except BaseException as e:
            error = e if isinstance(e, KVTransferError) else \
                PeerUnavailable(f"connection to sender {conn.peer} lost mid-frame")
            self.table.released(xfer_id, error)
            raise
        bad = None
        if digests is not None and self.table.is_live(xfer_id, head.generation):
            wrong = np.flatnonzero(digests != head.checksums)
            bad = int(wrong[0]) if len(wrong) else None
        self.table.landed_rows(xfer_id, rows, bad)

    async def _land_rows(self, conn: Conn, head: WriteHead, sizes: np.ndarray,
                         left: int) -> np.ndarray | None:
        """Receives the payload (`left` bytes) into the rows' cells, one range per run of
        adjacent rows; returns each row's checksum (None when unasked, or when the
        transfer was fenced meanwhile: the rest of the payload discarded)."""
        assert self.kv is not None
        sums = None if head.checksums is None else np.zeros(len(head.rows), np.uint64)
        for first, end, rank, off in runs(head.rows, sizes, self.table.layout):
            n = int(sizes[first:end].sum()) if end - first > 1 else int(sizes[first])
            if off < 0:  # a head slice: strided in its rank's cache
                region = rr.to_regions(head.rows[first:end], self.table.layout)[0]
                ok, digest = await self._land_slice(conn, head, region, n, sums is not None)
                if sums is not None:
                    sums[first] = digest
            else:
                dst = self.kv.rank_view(rank)[off:off + n]
                ok = await self._land(conn, head, dst)
                if ok and sums is not None:
                    row_checksums(dst, sizes, first, end, sums)
            left -= n
            if not ok:
                await self._discard(conn, left)
                return None
        return sums

    async def _land_slice(self, conn: Conn, head: WriteHead, region: Region, nbytes: int,
                          checksum: bool) -> tuple[bool, int]:
        """A head slice is strided in its rank's cache: its packed runs arrive a few
        blocks at a time, each part laid into place while the transfer is live (after a
        fence the rest of the slice is discarded). Returns (landed, the payload's
        checksum: 0 when unasked)."""
        assert self.kv is not None
        digest = xxhash.xxh3_64() if checksum else None
        left = nbytes
        parts = block_parts(region, nbytes, _SLICE_PART_BYTES)
        # This write's own buffer: other connections land their slices meanwhile.
        room = memoryview(bytearray(max(self.kv.region_bytes(p) for p in parts)))
        for part in parts:
            n = self.kv.region_bytes(part)
            buf = room[:n]
            if not await self._land(conn, head, buf):
                await self._discard(conn, left - n)
                return False, 0
            left -= n
            if digest is not None:
                digest.update(buf)
            self.kv.unpack(part, buf)
        return True, digest.intdigest() if digest is not None else 0

    async def _land(self, conn: Conn, head: WriteHead, dst: memoryview) -> bool:
        """Receive `len(dst)` payload bytes into `dst`, re-checking the fence per chunk;
        False if the transfer was fenced meanwhile (the rest of them discarded)."""
        loop = asyncio.get_running_loop()
        nbytes = len(dst)
        got = 0
        while got < nbytes:
            if not self.table.is_live(head.xfer_id, head.generation):
                await self._discard(conn, nbytes - got)  # fenced: nothing more lands
                return False
            try:
                k = await loop.sock_recv_into(conn.sock, dst[got:])
            except OSError as e:
                raise PeerUnavailable(f"connection to sender {conn.peer} lost: {e}") from e
            if k == 0:
                raise PeerUnavailable(f"sender {conn.peer} closed mid-frame")
            got += k
            conn.last_rx = loop.time()
        return self.table.is_live(head.xfer_id, head.generation)

    async def _discard(self, conn: Conn, nbytes: int) -> None:
        loop = asyncio.get_running_loop()
        while nbytes > 0:
            chunk = self._scratch[:min(nbytes, len(self._scratch))]
            await wire.recv_exact(loop, conn.sock, chunk)
            nbytes -= len(chunk)
            conn.last_rx = loop.time()


class TcpSender(SenderBase):
    name = "tcp"

    def __init__(self, config: TransferConfig, registry: CollectorRegistry | None = None,
                 ) -> None:
        super().__init__(config, registry)
        # Testing only (kvtransfer/faults.py); None unless faults are configured.
        self._faults = Faults(config.faults, "wire", registry) \
            if config.faults is not None and on_wire(config.faults) else None

    async def _send_regions(self, peer: Peer, pairs: Pairs,
                            xfer_id: str, generation: int, checksum: bool,
                            ready: Ready | None) -> None:
        assert self.kv is not None
        await wait_ready(ready)
        if self._faults is not None:
            pairs = self._faults.reorder(pairs)
        kv = self.kv
        src_rows = rr.side_rows(pairs, "src", kv.rank_layout)
        # the receiver's rows: its rank layout (its TP size's heads) resolves the open ends
        dst_rows = rr.side_rows(pairs, "dst",
                                rank_layout(kv.layout, int(peer.welcome.get("tp", 1))))
        sizes = rr.nbytes(src_rows, kv.rank_layout)
        # A CUDA cache's regions come over to the host a batch of blocks at a time
        staged = staged_regions(kv.tensor, kv.layout, [s for s, _ in pairs]) \
            if kv.is_cuda else None
        for start, end in batches(sizes):
            part = sizes[start:end]
            pieces, sums = self._payload(pairs[start:end], src_rows[start:end], part,
                                         checksum, staged)
            meta = WriteHead(xfer_id, generation, dst_rows[start:end], sums).pack()
            if await self._send_write(peer, wire.pack_frame(Frame.WRITE, meta,
                                                            int(part.sum())), pieces):
                # every WRITE frame is answered with the transfer's RESULT: no FINISH
                self._answered(peer, xfer_id, generation)

    def _payload(self, pairs: Pairs, rows: np.ndarray,
                 sizes: np.ndarray, checksum: bool, staged: Iterator[object] | None,
                 ) -> tuple[list[Iterable[memoryview]], np.ndarray | None]:
        """One frame's payload in row order, as pieces to send (a run of rows adjacent in
        the cache is one view of it; a head slice without a checksum is packed a few
        blocks at a time as it is sent), and each row's checksum (None when unasked)."""
        assert self.kv is not None
        sums = np.zeros(len(rows), np.uint64) if checksum else None
        pieces: list[Iterable[memoryview]] = []
        if staged is not None:
            for i in range(len(rows)):
                data = host_bytes(next(staged))  # type: ignore[arg-type]
                pieces.append((data,))
                if sums is not None:
                    sums[i] = compute_checksum(data)
            return pieces, sums
        for first, end, rank, off in runs(rows, sizes, self.kv.rank_layout):
            if off >= 0:
                view = self.kv.rank_view(rank)[off:off + int(sizes[first:end].sum())]
                pieces.append((view,))
                if sums is not None:
                    row_checksums(view, sizes, first, end, sums)
            elif sums is not None:
                data = self.kv.payload(pairs[first][0])
                sums[first] = compute_checksum(data)
                pieces.append((data,))
            else:
                pieces.append(self.kv.payload_parts(pairs[first][0], _SLICE_PART_BYTES))
        return pieces, sums

    async def _send_write(self, peer: Peer, head: bytes,
                          pieces: list[Iterable[memoryview]]) -> bool:
        """One WRITE frame: its header, then its payload's pieces; returns whether it
        went out (False: the fault injector dropped it). A frame once begun is
        sent whole even if its write is cancelled (a client gone, a Prefill's deadline):
        a half-sent frame would leave the connection's other transfers reading payload
        as headers. The bytes land in the cancelled transfer's own cells, which its
        CANCEL then fences; a stalled socket is ended by the write's deadline or the
        peer's liveness check, which fail the peer."""
        loop = asyncio.get_running_loop()

        async def send() -> bool:
            # The lock is per frame, so concurrent transfers interleave frame by frame.
            async with peer.send_lock:
                peer.check()
                if self._faults is not None:
                    data = b"".join(chain.from_iterable(pieces))
                    return await self._faults.send_write(loop, peer.sock, head, data)
                await wire.send_all(loop, peer.sock, head)
                for piece in chain.from_iterable(pieces):
                    await wire.send_all(loop, peer.sock, piece)
                return True

        frame = asyncio.ensure_future(send())
        frame.add_done_callback(_retrieved)
        return await asyncio.shield(frame)


def _retrieved(task: asyncio.Future[bool]) -> None:
    """A shielded frame's error reaches its writer, or nobody once the writer was
    cancelled (the peer is failed then by its deadline or liveness check)."""
    if not task.cancelled():
        task.exception()


__all__ = ["TcpReceiver", "TcpSender"]
