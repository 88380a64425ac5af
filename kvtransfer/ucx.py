"""`ucx`: control frames on the TCP channel, KV bytes over UCX tag messages.

Connection setup keeps UCX's fast path: the receiver's worker address travels in
the (authenticated) WELCOME frame and the sender creates its endpoint with
`create_endpoint_from_worker_address(..., endpoint_error_handling=False)`. With
error handling on (ucxx's listener path) UCX drops cross-memory attach and falls
back to TCP over loopback (0.3-0.6 GB/s vs 5-7 GB/s with `cma` here). Peer
failures are detected by the control channel instead (deadlines, heartbeats).

Per WRITE frame both sides count a sequence number (frames are ordered on the
control stream), so the payload's tag `tag_base | seq` needs no extra bytes. The
receiver posts a tag receive straight into the destination blocks (host memory,
or device memory when the cache is on CUDA: UCX then uses cuda_ipc / RDMA).

Faults: a receiver killed or stopped mid-transfer gives the sender PeerUnavailable
or TransferTimeout from the control channel, with error handling off. The crashes
seen earlier ("Fatal Python error: Aborted" / SIGSEGV in malloc after a failed
transfer) were heap corruption, not UCX: the scratch buffer a stale write drains
into was freed while its tag receive was still posted (ucxx keeps a raw pointer);
the receive task now owns it. Left: after a SIGSTOPped receiver, UCX keeps its TCP
connection to it until the worker can be torn down (a send is still in flight).

UCX options (UCX_TLS etc.) come from `TransferConfig.ucx_options`, passed to the
UCX context at creation; nothing here reads the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import secrets
from typing import Any

from kvtransfer import wire
from kvtransfer.errors import KVTransferError, PeerUnavailable, ProtocolError
from kvtransfer.layout import Region
from kvtransfer.memory import checksum as compute_checksum
from kvtransfer.receiver import Conn, ReceiverBase
from kvtransfer.sender import Peer, SenderBase
from kvtransfer.wire import Frame

log = logging.getLogger(__name__)
_SEQ_BITS = 24


def _context(options: tuple[tuple[str, str], ...]) -> Any:
    """A UCX context + worker of our own (not ucxx's module-level one)."""
    from ucxx._lib_async.application_context import ApplicationContext

    # Python futures: completions arrive through ucxx's notifier thread. Without
    # them every awaited request busy-yields (`wait_yield`), and on a small host the
    # spinning event loops starve the progress threads doing the copies
    # (64 MiB regions: 4 -> 7 GB/s here).
    ctx = ApplicationContext(dict(options), progress_mode="thread", enable_python_future=True)
    ctx.continuous_ucx_progress()
    return ctx


def _buffer(kv: Any, region: Region) -> Any:
    from ucxx._lib.arr import Array

    return Array(kv.device_slice(region) if kv.is_cuda else kv.view(region))


def _shutdown(ctx: Any) -> None:
    from ucxx._lib_async.application_context import ProgressTasks

    for loop, task in list(ProgressTasks.items()):
        if getattr(task, "worker", None) is ctx.worker:
            # ucxx patches loop.close to hold the progress task (and the worker, whose
            # listening sockets stay open) until the loop closes; let go of it now.
            task.worker = None
            del ProgressTasks[loop]
    with contextlib.suppress(Exception):
        ctx.worker.stop_progress_thread()
    with contextlib.suppress(Exception):
        ctx.stop_notifier_thread()


class UcxReceiver(ReceiverBase):
    name = "ucx"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ctx: Any = None
        self._seq: dict[int, int] = {}
        self._tag_base: dict[int, int] = {}
        self._recvs: dict[int, set[asyncio.Task[None]]] = {}

    async def start(self) -> None:
        self._ctx = _context(self.config.ucx_options)
        await super().start()

    async def close(self) -> None:
        tasks = [t for ts in self._recvs.values() for t in ts]
        if self._ctx is not None and tasks:
            self._ctx.worker.cancel_inflight_requests(10**9, 1)
        await asyncio.gather(*tasks, return_exceptions=True)
        await super().close()

    def _welcome_extra(self, conn: Conn) -> dict[str, Any]:
        # Random high bits: a tag cannot be guessed by a peer that skipped the handshake.
        self._tag_base[conn.id] = secrets.randbits(64 - _SEQ_BITS) << _SEQ_BITS
        self._seq[conn.id] = 0
        return {"ucx_address": self._ctx.worker_address.tobytes().hex(),
                "tag_base": self._tag_base[conn.id]}

    async def _on_write(self, conn: Conn, header: wire.WriteHeader, payload_len: int) -> None:
        from ucxx._lib.libucxx import UCXXTag

        assert self.kv is not None
        seq = self._seq[conn.id]
        self._seq[conn.id] = seq + 1
        tag = UCXXTag(self._tag_base[conn.id] | (seq & ((1 << _SEQ_BITS) - 1)))
        if payload_len:
            raise ProtocolError("ucx WRITE frames carry no inline payload")
        admitted = self.table.admit(header.xfer_id, header.generation, header.region, conn.id)
        if admitted:
            buf = _buffer(self.kv, header.region)
        else:  # drain the stale message into scratch so it never matches a real receive
            buf = _scratch(header.region.nbytes(self.kv.layout))
        request = self._ctx.worker.tag_recv(buf, tag)
        # The task holds `buf` until UCX is done with it: ucxx keeps only a raw
        # pointer, so a scratch buffer freed early is written after free (heap
        # corruption: the corrupt-payload and late-write tests crashed in malloc).
        task = asyncio.get_running_loop().create_task(
            self._complete(conn, header, request, admitted, buf))
        self._recvs.setdefault(conn.id, set()).add(task)
        task.add_done_callback(self._recvs[conn.id].discard)

    async def _complete(self, conn: Conn, header: wire.WriteHeader, request: Any,
                        admitted: bool, buf: Any) -> None:
        try:
            await request.wait()
        except BaseException as e:
            if admitted:
                self.table.released(header.xfer_id, e if isinstance(e, KVTransferError) else
                                    PeerUnavailable(f"ucx receive failed: {e!r}"))
            if not isinstance(e, Exception):
                raise
            return
        if not admitted:
            return
        conn.last_rx = asyncio.get_running_loop().time()
        ok = True
        if header.flags & wire.FLAG_CHECKSUM and self.table.is_live(header.xfer_id,
                                                                   header.generation):
            assert self.kv is not None
            ok = self.kv.checksum(header.region) == header.checksum
        self.table.landed(header.xfer_id, header.region, ok)

    def _on_conn_closed(self, conn: Conn) -> None:
        pending = self._recvs.pop(conn.id, set())
        if pending:
            # ucxx cannot cancel one request; a receive posted for a dead or hung
            # sender must not land later into a reused block, so cancel all in-flight
            # receives once the connection is gone (others fail, PeerUnavailable).
            log.warning("sender %s left %d receives in flight; cancelling", conn.peer,
                        len(pending))
            self._ctx.worker.cancel_inflight_requests(10**9, 1)
        self._seq.pop(conn.id, None)
        self._tag_base.pop(conn.id, None)

    def _close_memory(self) -> None:
        if self._ctx is not None:
            with contextlib.suppress(Exception):
                self._ctx.worker.cancel_inflight_requests(10**9, 1)
            _shutdown(self._ctx)
            self._ctx = None
            gc.collect()  # UCX's worker (and its sockets) go with the last reference


class UcxSender(SenderBase):
    name = "ucx"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ctx: Any = None

    async def _on_connected(self, peer: Peer) -> None:
        from ucxx._lib.libucxx import UCXAddress

        if self._ctx is None:
            self._ctx = _context(self.config.ucx_options)
        address = UCXAddress.create_from_buffer(bytes.fromhex(peer.welcome["ucx_address"]))
        endpoint = await self._ctx.create_endpoint_from_worker_address(
            address, endpoint_error_handling=self.config.ucx_error_handling)
        peer.state = {"ep": endpoint, "seq": 0, "tag_base": int(peer.welcome["tag_base"])}

    async def _send_regions(self, peer: Peer, pairs: list[tuple[Region, Region]],
                            xfer_id: str, generation: int, checksum: bool) -> None:
        assert self.kv is not None
        state = peer.state
        sends = []
        for src, dst in pairs:
            flags = wire.FLAG_CHECKSUM if checksum else 0
            csum = 0 if not checksum else (
                self.kv.checksum(src) if self.kv.is_cuda else compute_checksum(self.kv.view(src)))
            meta = wire.WriteHeader(xfer_id, generation, dst, flags, csum).pack()
            async with peer.send_lock:
                peer.check()
                seq = state["seq"]
                state["seq"] = seq + 1
                await wire.send_all(asyncio.get_running_loop(), peer.sock,
                                    wire.pack_frame(Frame.WRITE, meta))
            tag = state["tag_base"] | (seq & ((1 << _SEQ_BITS) - 1))
            # All regions of this call in flight at once; UCX pipelines them.
            sends.append(state["ep"].send(_buffer(self.kv, src), tag=tag, force_tag=True))
        await asyncio.gather(*sends)

    async def _on_disconnected(self, peer: Peer) -> None:
        if peer.state is not None:
            with contextlib.suppress(Exception):
                peer.state["ep"].abort()
            peer.state = None

    def _close_memory(self) -> None:
        if self._ctx is not None:
            with contextlib.suppress(Exception):
                self._ctx.worker.cancel_inflight_requests(10**9, 1)
            _shutdown(self._ctx)
            self._ctx = None
            gc.collect()  # UCX's worker (and its sockets) go with the last reference


def _scratch(nbytes: int) -> Any:
    from ucxx._lib.arr import Array

    return Array(bytearray(nbytes))
