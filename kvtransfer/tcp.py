"""`tcp`: KV bytes follow each WRITE header on the control stream itself.

The reference and fallback transport. The receiver reads a region's payload with
`sock_recv_into` straight into the destination blocks; if the transfer is fenced
mid-region, the rest of the payload goes to a scratch buffer instead, so no byte
of a stale write lands after the fence.
"""

from __future__ import annotations

import asyncio

import xxhash
from prometheus_client import CollectorRegistry

from kvtransfer import wire
from kvtransfer.config import TransferConfig
from kvtransfer.copy_kernel import staged_regions
from kvtransfer.errors import KVTransferError, PeerUnavailable, ProtocolError
from kvtransfer.faults import Faults, on_wire
from kvtransfer.layout import Region
from kvtransfer.memory import Ready, block_parts, host_bytes, wait_ready
from kvtransfer.memory import checksum as compute_checksum
from kvtransfer.receiver import Conn, ReceiverBase
from kvtransfer.sender import Peer, SenderBase
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

    async def _on_write(self, conn: Conn, header: wire.WriteHeader, payload_len: int) -> None:
        assert self.kv is not None
        admitted = self.table.admit(header.xfer_id, header.generation, header.region, conn.id)
        if not admitted:
            await self._discard(conn, payload_len)
            return
        region = header.region
        try:
            nbytes = self.kv.region_bytes(region)
            if payload_len != nbytes:
                raise ProtocolError(f"payload of {payload_len} bytes for a {nbytes}-byte region")
            if self.kv.contiguous(region):
                dst = self.kv.view(region)
                await self._land(conn, header, dst)
                digest = compute_checksum(dst) if header.flags & wire.FLAG_CHECKSUM else 0
            else:
                digest = await self._land_slice(conn, header, nbytes)
        except BaseException as e:
            error = e if isinstance(e, KVTransferError) else \
                PeerUnavailable(f"connection to sender {conn.peer} lost mid-region")
            self.table.released(header.xfer_id, error)
            raise
        ok = True
        if header.flags & wire.FLAG_CHECKSUM and self.table.is_live(header.xfer_id,
                                                                   header.generation):
            ok = digest == header.checksum
        self.table.landed(header.xfer_id, region, ok)

    async def _land_slice(self, conn: Conn, header: wire.WriteHeader, nbytes: int) -> int:
        """A head slice is strided in its rank's cache: its packed runs arrive a few
        blocks at a time, each part laid into place while the transfer is live (after a
        fence the rest is discarded). Returns the payload's checksum (0 when unasked)."""
        assert self.kv is not None
        digest = xxhash.xxh3_64() if header.flags & wire.FLAG_CHECKSUM else None
        left = nbytes
        parts = block_parts(header.region, nbytes, _SLICE_PART_BYTES)
        # This write's own buffer: other connections land their slices meanwhile.
        room = memoryview(bytearray(max(self.kv.region_bytes(p) for p in parts)))
        for part in parts:
            n = self.kv.region_bytes(part)
            buf = room[:n]
            if not await self._land(conn, header, buf):
                await self._discard(conn, left - n)
                return 0
            left -= n
            if digest is not None:
                digest.update(buf)
            self.kv.unpack(part, buf)
        return digest.intdigest() if digest is not None else 0

    async def _land(self, conn: Conn, header: wire.WriteHeader, dst: memoryview) -> bool:
        """Receive `len(dst)` payload bytes into `dst`, re-checking the fence per chunk;
        False if the transfer was fenced meanwhile (the rest of them discarded)."""
        loop = asyncio.get_running_loop()
        nbytes = len(dst)
        got = 0
        while got < nbytes:
            if not self.table.is_live(header.xfer_id, header.generation):
                await self._discard(conn, nbytes - got)  # fenced: nothing more lands
                return False
            try:
                k = await loop.sock_recv_into(conn.sock, dst[got:])
            except OSError as e:
                raise PeerUnavailable(f"connection to sender {conn.peer} lost: {e}") from e
            if k == 0:
                raise PeerUnavailable(f"sender {conn.peer} closed mid-region")
            got += k
            conn.last_rx = loop.time()
        return self.table.is_live(header.xfer_id, header.generation)

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

    async def _send_regions(self, peer: Peer, pairs: list[tuple[Region, Region]],
                            xfer_id: str, generation: int, checksum: bool,
                            ready: Ready | None) -> None:
        assert self.kv is not None
        loop = asyncio.get_running_loop()
        await wait_ready(ready)
        if self._faults is not None:
            pairs = self._faults.reorder(pairs)
        # A CUDA cache's regions come over to the host a batch of blocks at a time
        staged = staged_regions(self.kv.tensor, self.kv.layout, [s for s, _ in pairs]) \
            if self.kv.is_cuda else None
        for src, dst in pairs:
            # a head slice without a checksum is packed and sent a few blocks at a time
            parts = None
            if staged is None and not checksum and not self.kv.contiguous(src):
                parts, data = self.kv.payload_parts(src, _SLICE_PART_BYTES), None
            else:
                data = self.kv.payload(src) if staged is None else host_bytes(next(staged))
            flags = wire.FLAG_CHECKSUM if checksum else 0
            header = wire.WriteHeader(xfer_id, generation, dst, flags,
                                      compute_checksum(data) if data is not None and checksum
                                      else 0)
            meta = header.pack()
            size = len(data) if data is not None else self.kv.region_bytes(src)
            # The lock is per region, so concurrent transfers interleave region by region.
            async with peer.send_lock:
                peer.check()
                head = wire.pack_frame(Frame.WRITE, meta, size)
                if self._faults is not None:
                    data = data if data is not None else host_bytes(
                        self.kv.tensor_of(src).contiguous())
                    await self._faults.send_write(loop, peer.sock, head, data)
                    continue
                await wire.send_all(loop, peer.sock, head)
                for piece in parts if parts is not None else (data,):
                    await wire.send_all(loop, peer.sock, piece)


__all__ = ["TcpReceiver", "TcpSender"]
