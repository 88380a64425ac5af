"""`tcp`: KV bytes follow each WRITE header on the control stream itself.

The reference and fallback transport. The receiver reads a region's payload with
`sock_recv_into` straight into the destination blocks; if the transfer is fenced
mid-region, the rest of the payload goes to a scratch buffer instead, so no byte
of a stale write lands after the fence.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from kvtransfer import wire
from kvtransfer.config import TransferConfig
from kvtransfer.copy_kernel import staged_regions
from kvtransfer.errors import KVTransferError, PeerUnavailable, ProtocolError
from kvtransfer.faults import Faults, on_wire
from kvtransfer.layout import Region
from kvtransfer.memory import Ready, host_bytes, wait_ready
from kvtransfer.memory import checksum as compute_checksum
from kvtransfer.receiver import Conn, ReceiverBase
from kvtransfer.sender import Peer, SenderBase
from kvtransfer.wire import Frame

_SCRATCH_BYTES = 1 << 20


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
            # A head slice is strided in the rank's cache: its runs arrive packed and are
            # laid into place once all arrived (and the transfer is still live)
            dst = self.kv.view(region) if self.kv.contiguous(region) \
                else memoryview(bytearray(nbytes))
            if await self._land(conn, header, dst) and not self.kv.contiguous(region):
                self.kv.unpack(region, dst)
        except BaseException as e:
            error = e if isinstance(e, KVTransferError) else \
                PeerUnavailable(f"connection to sender {conn.peer} lost mid-region")
            self.table.released(header.xfer_id, error)
            raise
        ok = True
        if header.flags & wire.FLAG_CHECKSUM and self.table.is_live(header.xfer_id,
                                                                   header.generation):
            ok = compute_checksum(dst) == header.checksum
        self.table.landed(header.xfer_id, region, ok)

    async def _land(self, conn: Conn, header: wire.WriteHeader, dst: memoryview) -> bool:
        """Receive the payload into `dst`, re-checking the fence per chunk; False if the
        transfer was fenced meanwhile (the rest of the payload discarded)."""
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
            data = self.kv.payload(src) if staged is None else host_bytes(next(staged))
            flags = wire.FLAG_CHECKSUM if checksum else 0
            header = wire.WriteHeader(xfer_id, generation, dst, flags,
                                      compute_checksum(data) if checksum else 0)
            meta = header.pack()
            # The lock is per region, so concurrent transfers interleave region by region.
            async with peer.send_lock:
                peer.check()
                head = wire.pack_frame(Frame.WRITE, meta, len(data))
                if self._faults is not None:
                    await self._faults.send_write(loop, peer.sock, head, data)
                    continue
                await wire.send_all(loop, peer.sock, head)
                await wire.send_all(loop, peer.sock, data)


__all__ = ["TcpReceiver", "TcpSender"]
