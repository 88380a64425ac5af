"""`ucx`: control frames on the TCP channel, KV bytes over UCX tag messages.

Connection setup keeps UCX's fast path: the receiver's worker addresses travel in
the (authenticated) WELCOME frame and the sender creates its endpoints from them
with endpoint error handling off. With error handling on (ucxx's listener path)
UCX drops cross-memory attach and falls back to TCP over loopback (0.3-0.6 GB/s vs
4-7 GB/s with `cma` here). Peer failures are detected by the control channel
instead (deadlines, heartbeats).

Per WRITE frame both sides count a sequence number (frames are ordered on the
control stream), so the payload's tag `tag_base | seq` needs no extra bytes. The
receiver posts a tag receive straight into the destination blocks (host memory,
or device memory when the cache is on CUDA: UCX then uses cuda_ipc / RDMA).

Lanes: the receiver runs `config.ucx_lanes` UCX workers, each a `_Lane` with its
own progress thread, and lists their addresses in WELCOME; the sender opens one
endpoint per lane. A region of `_SPLIT_MIN` bytes or more is cut into one
page-aligned part per lane (`_parts`, the same rule on both sides), each sent and
received under the region's tag on its own lane. UCX moves host bytes with
rendezvous reads (process_vm_readv) done by the receiver's progress thread; one
such stream tops out at ~4.3 GB/s on this host, two lanes reach ~7 GB/s. A region
lands only once every part has completed.

Every lane is wired up before the first WRITE: seqs 0..lanes-1 are one
rendezvous-sized message per lane, which the sender awaits in `connect()`. A peer
that dies while UCX is still wiring an endpoint up (error handling off) corrupts
the sender's heap; after this round trip a dead peer is only a silent one.

Faults: a receiver killed or stopped mid-transfer gives the sender PeerUnavailable
or TransferTimeout from the control channel. A sender that goes away leaves receives
posted into destination blocks, which ucxx cannot cancel; the receiver completes them
with an empty message from the lane to itself (`_Lane.unblock`), so the fenced
transfer resolves and its blocks are free; the sender's message, if it still comes,
matches nothing. A stale write drains into a scratch buffer owned by its receive task
(ucxx keeps only a raw pointer to a buffer).
Left: after a SIGSTOPped receiver, UCX keeps its TCP connection to it until the
worker can be torn down (a send is still in flight).

UCX options (UCX_TLS etc.) come from `TransferConfig.ucx_options_for(cuda)`, passed
to the UCX context at creation; nothing here reads the environment.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import secrets
import threading
import time
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
_SEQ_MASK = (1 << _SEQ_BITS) - 1
_SPLIT_MIN = 1 << 20  # smaller regions travel whole, on lane 0
_ALIGN = 4096
# Above the rendezvous threshold (config.HOST_UCX_OPTIONS): the wire-up send
# completes only once the receiver has fetched it, i.e. both directions are up.
_WIREUP_BYTES = 64 << 10
_MAX_LANES = 8
_EPOLL_MS = 50


def _parts(nbytes: int, lanes: int) -> list[tuple[int, int]]:
    """(offset, nbytes) of each lane's part of a region: page-aligned, near-equal."""
    if lanes == 1 or nbytes < _SPLIT_MIN:
        return [(0, nbytes)]
    step = -(-nbytes // lanes // _ALIGN) * _ALIGN
    return [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]


def _buffers(kv: Any, region: Region, lanes: int) -> list[Any]:
    """One ucxx Array per lane part of `region` (views into the registered cache)."""
    from ucxx._lib.arr import Array

    whole = kv.device_slice(region) if kv.is_cuda else kv.view(region)
    return [Array(whole[off:off + n]) for off, n in _parts(len(whole), lanes)]


def _scratch(nbytes: int, lanes: int) -> list[Any]:
    from ucxx._lib.arr import Array

    whole = memoryview(bytearray(nbytes))
    return [Array(whole[off:off + n]) for off, n in _parts(nbytes, lanes)]


def _tag(value: int) -> Any:
    from ucxx._lib.libucxx import UCXXTag

    return UCXXTag(value)


class _Lane:
    """One UCX context and worker with its own progress and notifier threads.

    Not ucxx's ApplicationContext: that keeps one progress thread per event loop in
    a module-global table, so a second context on the same loop (a decode worker's
    receiver and sender, or a receiver's lanes) is never progressed, and collecting
    any context clears the whole table. Requests are submitted by the progress
    thread (delayed submission: a UCX worker is not thread-safe) and completed on
    `loop` through Python futures, which the notifier thread resolves; without them
    every awaited request busy-yields and starves the progress threads.
    """

    def __init__(self, options: tuple[tuple[str, str], ...],
                 loop: asyncio.AbstractEventLoop) -> None:
        from ucxx._lib import libucxx as ucx_api
        from ucxx._lib_async.continuous_ucx_progress import _create_context
        from ucxx._lib_async.notifier_thread import _notifierThread

        self.context = ucx_api.UCXContext(dict(options))
        self.worker = ucx_api.UCXWorker(self.context, enable_delayed_submission=True,
                                        enable_python_future=True)
        # The progress thread needs a CUDA context for device buffers (cuda_ipc).
        self.worker.set_progress_thread_start_callback(_create_context)
        # Woken by UCX events and by every submission (ucxx signals the worker); the
        # timeout is only a safety net. ucxx's 1 ms wakes three idle progress threads
        # 1000 times a second, which costs the copying lanes ~8% on two cores.
        self.worker.start_progress_thread(polling_mode=False, epoll_timeout=_EPOLL_MS)
        self._stop: queue.Queue[str] = queue.Queue()
        self._notifier = threading.Thread(target=_notifierThread,
                                          args=(loop, self.worker, self._stop),
                                          name="kvtransfer-ucx-notifier", daemon=True)
        self._notifier.start()
        self._self_ep: Any = None
        self._unblocks: list[tuple[Any, Any]] = []  # empty sends in flight, with buffers

    @property
    def address(self) -> str:
        return bytes(self.worker.address.tobytes()).hex()

    def connect(self, address: str, error_handling: bool) -> Any:
        from ucxx._lib import libucxx as ucx_api

        peer = ucx_api.UCXAddress.create_from_buffer(bytes.fromhex(address))
        return ucx_api.UCXEndpoint.create_from_worker_address(self.worker, peer,
                                                              error_handling)

    def unblock(self, tag: int) -> None:
        """Complete this worker's receive posted for `tag` with an empty message."""
        from ucxx._lib.arr import Array

        if self._self_ep is None:
            self._self_ep = self.connect(self.address, False)
        buf = Array(bytearray(0))
        self._unblocks.append((self._self_ep.tag_send(buf, _tag(tag)), buf))
        self._unblocks = [(r, b) for r, b in self._unblocks if not r.completed]

    def cancel_inflight(self) -> None:
        try:
            self.worker.cancel_inflight_requests(10**9, 1)
        except Exception as e:  # noqa: BLE001 - best effort at teardown
            log.debug("ucx cancel_inflight_requests: %r", e)

    def close(self) -> None:
        """Cancel what is in flight, stop both threads; the worker goes with the
        last reference (its sockets with it)."""
        if self._self_ep is not None:
            try:
                self._self_ep.close_blocking(period=10**9, max_attempts=1)
            except Exception as e:  # noqa: BLE001
                log.debug("ucx self endpoint close: %r", e)
            self._self_ep = None
        self.cancel_inflight()
        try:
            self.worker.stop_progress_thread()
        except Exception as e:  # noqa: BLE001
            log.debug("ucx stop_progress_thread: %r", e)
        self._stop.put("shutdown")
        self.worker.stop_request_notifier_thread()
        deadline = time.monotonic() + 5.0
        # Short joins: the notifier may need the GIL to finish (ucxx does the same).
        while self._notifier.is_alive() and time.monotonic() < deadline:
            self._notifier.join(timeout=0.01)
        if self._notifier.is_alive():
            log.warning("ucx notifier thread did not stop within 5 s")


def _close_lanes(lanes: list[_Lane]) -> None:
    for lane in lanes:
        lane.close()
    lanes.clear()
    gc.collect()  # UCX's workers (and their sockets) go with the last reference


class _Posted:
    """Receives posted for one message: one request and buffer per lane part."""

    __slots__ = ("tag", "lanes", "requests", "bufs", "unblocked")

    def __init__(self, tag: int, lanes: list[_Lane], bufs: list[Any]) -> None:
        self.tag = tag
        self.lanes = lanes[:len(bufs)]
        self.requests = [lane.worker.tag_recv(buf, _tag(tag))
                         for lane, buf in zip(self.lanes, bufs, strict=True)]
        self.bufs = bufs  # held until UCX is done: ucxx keeps only a raw pointer
        self.unblocked = False


class UcxReceiver(ReceiverBase):
    name = "ucx"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lanes: list[_Lane] = []
        self._seq: dict[int, int] = {}
        self._tag_base: dict[int, int] = {}
        self._posted: dict[int, dict[asyncio.Task[None], _Posted]] = {}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.kv is not None, "register() the KV cache first"
        options = self.config.ucx_options_for(self.kv.is_cuda)
        self._lanes = [_Lane(options, loop)
                       for _ in range(self.config.ucx_lanes)]
        await super().start()

    async def close(self) -> None:
        tasks = [t for posted in self._posted.values() for t in posted]
        for conn_id in list(self._posted):
            self._unblock(conn_id)
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.io_timeout_s)
        await super().close()

    def _welcome_extra(self, conn: Conn) -> dict[str, Any]:
        # Random high bits: a tag cannot be guessed by a peer that skipped the handshake.
        base = secrets.randbits(64 - _SEQ_BITS) << _SEQ_BITS
        self._tag_base[conn.id] = base
        for seq, lane in enumerate(self._lanes):  # the wire-up message of each lane
            self._post(conn, base | seq, _scratch(_WIREUP_BYTES, 1), [lane], None)
        self._seq[conn.id] = len(self._lanes)
        return {"ucx_lanes": [lane.address for lane in self._lanes], "tag_base": base}

    async def _on_write(self, conn: Conn, header: wire.WriteHeader, payload_len: int) -> None:
        assert self.kv is not None
        if payload_len:
            raise ProtocolError("ucx WRITE frames carry no inline payload")
        seq = self._seq[conn.id]
        self._seq[conn.id] = seq + 1
        tag = self._tag_base[conn.id] | (seq & _SEQ_MASK)
        lanes = len(self._lanes)
        if self.table.admit(header.xfer_id, header.generation, header.region, conn.id):
            self._post(conn, tag, _buffers(self.kv, header.region, lanes), self._lanes, header)
        else:  # drain the stale message into scratch so it never matches a real receive
            self._post(conn, tag, _scratch(header.region.nbytes(self.kv.layout), lanes),
                       self._lanes, None)

    def _post(self, conn: Conn, tag: int, bufs: list[Any], lanes: list[_Lane],
              header: wire.WriteHeader | None) -> None:
        """Post one receive per part; `header` is None for a drain (nothing lands)."""
        posted = _Posted(tag, lanes, bufs)
        task = asyncio.get_running_loop().create_task(self._complete(conn, header, posted))
        table = self._posted.setdefault(conn.id, {})
        table[task] = posted

        def done(t: asyncio.Task[None]) -> None:
            table.pop(t, None)
            if not table and conn.id not in self._conns:  # the connection's last one
                self._posted.pop(conn.id, None)

        task.add_done_callback(done)

    async def _complete(self, conn: Conn, header: wire.WriteHeader | None,
                        posted: _Posted) -> None:
        results = await asyncio.gather(*(r.wait() for r in posted.requests),
                                       return_exceptions=True)
        if header is None:
            return
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is None and posted.unblocked:
            error = PeerUnavailable(f"sender {conn.peer} left with the region in flight")
        if error is not None:
            self.table.released(header.xfer_id, error if isinstance(error, KVTransferError)
                                else PeerUnavailable(f"ucx receive failed: {error!r}"))
            if not isinstance(error, Exception):
                raise error
            return
        conn.last_rx = asyncio.get_running_loop().time()
        ok = True
        if header.flags & wire.FLAG_CHECKSUM and self.table.is_live(header.xfer_id,
                                                                   header.generation):
            assert self.kv is not None
            ok = self.kv.checksum(header.region) == header.checksum
        self.table.landed(header.xfer_id, header.region, ok)

    def _unblock(self, conn_id: int) -> None:
        """Complete every receive still posted for a connection with an empty message
        from the lane to itself (ucxx cannot cancel a worker's tag receive; its
        cancel_inflight_requests covers endpoint requests only). The sender's real
        message, if it comes later, matches nothing and lands nowhere."""
        for posted in self._posted.get(conn_id, {}).values():
            if posted.unblocked:
                continue
            posted.unblocked = True
            for lane, request in zip(posted.lanes, posted.requests, strict=True):
                if not request.completed:
                    lane.unblock(posted.tag)

    def _on_conn_closed(self, conn: Conn) -> None:
        if self._posted.get(conn.id):
            log.warning("sender %s left %d receives in flight; unblocking them", conn.peer,
                        len(self._posted[conn.id]))
            self._unblock(conn.id)
        else:
            self._posted.pop(conn.id, None)
        self._seq.pop(conn.id, None)
        self._tag_base.pop(conn.id, None)

    def _close_memory(self) -> None:
        self._posted.clear()
        _close_lanes(self._lanes)


class UcxSender(SenderBase):
    name = "ucx"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lanes: list[_Lane] = []  # one worker: the receiver's lanes do the copies

    async def _on_connected(self, peer: Peer) -> None:
        from ucxx._lib.arr import Array

        addresses = peer.welcome.get("ucx_lanes")
        if not isinstance(addresses, list) or not 1 <= len(addresses) <= _MAX_LANES:
            raise ProtocolError("ucx WELCOME without a valid lane list")
        if not self._lanes:
            assert self.kv is not None
            self._lanes.append(_Lane(self.config.ucx_options_for(self.kv.is_cuda),
                                     asyncio.get_running_loop()))
        lane = self._lanes[0]
        base = int(peer.welcome["tag_base"])
        eps: list[Any] = []
        state = peer.state = {"eps": eps, "seq": len(addresses), "tag_base": base,
                              "inflight": set()}
        for address in addresses:
            eps.append(lane.connect(str(address), self.config.ucx_error_handling))
        # Wire every lane up now (see the module docstring); connect() bounds this.
        # The buffers live as long as the endpoints: a send cut short by connect()'s
        # deadline may still be read by the peer.
        state["wireup"] = [Array(bytearray(_WIREUP_BYTES)) for _ in eps]
        await asyncio.gather(*(ep.tag_send(buf, _tag(base | seq)).wait()
                               for seq, (ep, buf) in enumerate(zip(eps, state["wireup"],
                                                                   strict=True))))

    async def _send_regions(self, peer: Peer, pairs: list[tuple[Region, Region]],
                            xfer_id: str, generation: int, checksum: bool) -> None:
        assert self.kv is not None
        state = peer.state
        requests: list[Any] = []
        bufs: list[Any] = []  # held until UCX is done with them
        try:
            for src, dst in pairs:
                flags = wire.FLAG_CHECKSUM if checksum else 0
                csum = 0 if not checksum else (self.kv.checksum(src) if self.kv.is_cuda
                                               else compute_checksum(self.kv.view(src)))
                meta = wire.WriteHeader(xfer_id, generation, dst, flags, csum).pack()
                async with peer.send_lock:
                    peer.check()
                    seq = state["seq"]
                    state["seq"] = seq + 1
                    await wire.send_all(asyncio.get_running_loop(), peer.sock,
                                        wire.pack_frame(Frame.WRITE, meta))
                tag = _tag(state["tag_base"] | (seq & _SEQ_MASK))
                for ep, buf in zip(state["eps"], _buffers(self.kv, src, len(state["eps"])),
                                   strict=False):
                    bufs.append(buf)
                    requests.append(ep.tag_send(buf, tag))
        finally:
            # Handed to UCX: write() returns now and finish() waits for the receiver's
            # verdict; this task keeps the buffers until the sends complete.
            if requests:
                task = asyncio.get_running_loop().create_task(
                    self._sent(peer, requests, bufs))
                state["inflight"].add(task)
                task.add_done_callback(state["inflight"].discard)

    async def _sent(self, peer: Peer, requests: list[Any], bufs: list[Any]) -> None:
        results = await asyncio.gather(*(r.wait() for r in requests), return_exceptions=True)
        del bufs
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None and peer.alive:
            self._fail_peer(peer, PeerUnavailable(f"ucx send failed: {error!r}"))

    async def _on_disconnected(self, peer: Peer) -> None:
        if peer.state is None:
            return
        state, peer.state = peer.state, None
        for ep in state["eps"]:
            try:
                ep.close_blocking(period=10**9, max_attempts=1)
                ep.remove_close_callback()
            except Exception as e:  # noqa: BLE001 - the peer may be gone
                log.debug("ucx endpoint close: %r", e)
        # Sends to a dead peer never complete (error handling off): stop waiting.
        for task in state["inflight"]:
            task.cancel()
        await asyncio.gather(*state["inflight"], return_exceptions=True)

    def _close_memory(self) -> None:
        _close_lanes(self._lanes)
