"""`ucx`: one-sided RMA puts in NIXL's model; TCP carries only control frames.

Registration happens once. The receiver maps its whole KV cache with its UCP context
(`ucp_mem_map`) and sends its worker address, the packed remote key and the cache's
base address in WELCOME (after the token proof: only an authenticated sender gets a
key to the cache), and on the host its `host_copy.identity()`. The sender maps its own
cache once per lane, and per lane opens one endpoint to the receiver's worker and
unpacks the remote key on it (not to a receiver on its node: see "Same node" below).

The sender holds the in-place writers' grant for the transfer (`kvtransfer/inplace.py`:
asked for once, revocable; the fence a put needs, since it lands before the receiver
could look at it). Per `write()` (one chunk of a prefill) it puts the chunk's regions
as one batch of `ucp_put_nbx` per lane and ONE `ucp_ep_flush_nbx` per lane (into a
receiver on its node: `process_vm_writev` calls per lane), then sends one WRITTEN
notice. No UCX tag message carries KV; tags are not used at all.

Between TP sizes a region arrives as per-rank head slices, one strided run per
(block, layer, K/V, token) on at least one side. Put one by one, ~10^5 runs of 2 KiB
cost more than their bytes, so the slices a destination rank takes of a region are
packed on the host into a registered bounce buffer as that rank's blocks and put as
one range each (`kvtransfer/bounce.py`); on a device cache they go run by run
(`memory.byte_runs`). The rows a write puts, (local address, nbytes, remote address)
by rank pair, are `ucx_puts.put_rows`.

ucxx has no Python RMA API (see `kvtransfer/ucp_rma.py`), so puts and flushes go to
libucp through ctypes on ucxx's handles; ucxx still owns contexts, workers, progress
threads and endpoints.

Lanes: the sender runs `config.ucx_lanes` UCX workers, each a `ucx_lanes.Lane` with
its own progress thread, endpoint and remote key, and issues each lane's puts from its
own thread (ctypes drops the GIL). A region of 1 MiB or more is cut into page-aligned
parts across lanes; smaller ones go in consecutive stretches that even out the lanes'
bytes (`ucx_puts.plan_lanes`).

Same node: every endpoint runs with UCX's peer error handling, so a receiver's death is
an error status, never an abort of the sender; UCX then has no `cma` for RMA (see
`kvtransfer/host_copy.py`). So into a host-memory receiver on this node (same boot and
PID namespace, and readable: WELCOME carries its `identity()`) the sender copies each
lane's list itself with batched `process_vm_writev` (the syscall `cma` makes), from the
same lane threads, two lanes on two cores; no UCX endpoint is opened to it. A receiver
that dies mid-copy fails the write with PeerUnavailable at the lane's next call. Other
receivers (another node, a GPU cache) get UCX puts: RDMA or cuda_ipc where UCX has
them, RMA emulated over TCP between hosts without RDMA.

Faults: a sender that dies mid-copy cannot hurt the receiver: its grant's bound passes
and the blocks are reused.

UCX options (UCX_TLS etc.) come from `TransferConfig.ucx_options_for(cuda)`, passed
to the UCX context at creation; nothing here reads the environment.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer import bounce
from kvtransfer.errors import PeerUnavailable, ProtocolError, TransferTimeout
from kvtransfer.host_copy import HostCopy, identity
from kvtransfer.inplace import InPlaceReceiver
from kvtransfer.inplace_sender import InPlaceSender
from kvtransfer.layout import KVLayout, Pairs, rank_layout
from kvtransfer.memory import Ready, device_ready, wait_ready
from kvtransfer.receiver import Conn
from kvtransfer.sender import Peer
from kvtransfer.ucp_rma import Batch, Flushes, Ucp
from kvtransfer.ucx_lanes import Lane, close_endpoint, close_lanes
from kvtransfer.ucx_puts import plan_lanes, put_rows

log = logging.getLogger(__name__)
_BOUNCE_BYTES = 16 << 20  # head slices packed per put batch (two such buffers)
_MAX_LANES = 8
_WIREUP_BYTES = 64


class UcxReceiver(InPlaceReceiver):
    """Passive: registers the cache, hands out its remote key, grants and lands."""

    name = "ucx"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lanes: list[Lane] = []
        self._ucp: Ucp | None = None
        self._memhs: list[int] = []
        self._welcome_info: dict[str, Any] = {}

    async def start(self) -> None:
        assert self.kv is not None, "register() the KV cache first"
        kv = self.kv
        self._ucp = Ucp()
        # One worker: its progress thread serves what the target side must (TCP-emulated
        # RMA between hosts without RDMA); RDMA and cuda_ipc need nothing here, and a
        # sender on this node writes host memory itself (`host_copy`).
        lane = Lane(self.config.ucx_options_for(kv.is_cuda), asyncio.get_running_loop())
        self._lanes = [lane]
        # every rank's cache (tensor parallelism: rank 0 maps them all), one key each
        bases = [int(t.data_ptr()) for t in kv.tensors]
        self._memhs = [self._ucp.mem_map(lane.context.handle, b, kv.nbytes, kv.is_cuda)
                       for b in bases]
        self._welcome_info = {
            "ucx_worker": lane.address, "bases": bases, "nbytes": kv.nbytes,
            "node": None if kv.is_cuda else identity(),
            "rkeys": [self._ucp.rkey_pack(lane.context.handle, m).hex() for m in self._memhs]}
        await super().start()

    async def _welcome(self, conn: Conn, hello: dict[str, Any]) -> dict[str, Any]:
        return {**await super()._welcome(conn, hello), **self._welcome_info}

    def _close_memory(self) -> None:
        super()._close_memory()
        if self._ucp is not None and self._lanes:
            for memh in self._memhs:
                self._ucp.mem_unmap(self._lanes[0].context.handle, memh)
        self._memhs = []
        close_lanes(self._lanes)


@dataclass(slots=True)
class _Remote:
    """A receiver as this sender sees it: its caches' bases (one per rank) and size, and
    per lane an endpoint to its worker and its remote keys unpacked on that endpoint."""

    bases: list[int]
    nbytes: int
    eps: list[Any] = field(default_factory=list)
    rkeys: list[list[int]] = field(default_factory=list)  # [lane][rank]
    busy: int = 0  # copies and batches that may still issue on these endpoints
    issuing: set[Any] = field(default_factory=set)  # lane threads' batches not returned
    # Its own bounce buffers (a stalled receiver holds up no other's packed puts); made
    # at its first packed write.
    packer: bounce.Packer | None = None
    closed: bool = False  # disconnected: nothing may issue on its endpoints or keys
    host: HostCopy | None = None  # a host-memory receiver on this node: copied directly

    def close(self) -> None:
        """Nothing issues on its endpoints or keys any more, no host copy goes on."""
        self.closed = True
        if self.host is not None:
            self.host.stop()


class UcxSender(InPlaceSender):
    name = "ucx"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lanes: list[Lane] = []
        self._memhs: list[list[int]] = []  # [lane][rank]
        self._batches: list[Batch] = []
        self._ucp: Ucp | None = None
        self._flushes: Flushes | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._scratch: Any = None
        self._packers: set[bounce.Packer] = set()  # the receivers' bounce buffers, not freed
        self._freeing: set[asyncio.Future[None]] = set()  # _free_packer tasks in flight

    def _open(self) -> None:
        if not self._lanes:
            self._open_lanes()

    def _open_lanes(self) -> None:
        """Lanes, registrations and threads, once, at the first connection."""
        assert self.kv is not None
        kv, loop = self.kv, asyncio.get_running_loop()
        self._ucp = ucp = Ucp()
        self._flushes = Flushes(ucp, loop)
        options = self.config.ucx_options_for(kv.is_cuda)
        for _ in range(self.config.ucx_lanes):
            lane = Lane(options, loop)
            self._lanes.append(lane)
            self._memhs.append([ucp.mem_map(lane.context.handle, int(t.data_ptr()), kv.nbytes,
                                            kv.is_cuda) for t in kv.tensors])
            self._batches.append(Batch(ucp, lane.worker.handle, self._flushes))
        # The issuing threads need the device's CUDA context current (cuda_ipc copies).
        init = functools.partial(torch.cuda.set_device, kv.tensor.device) if kv.is_cuda \
            else None
        self._pool = ThreadPoolExecutor(len(self._lanes), "kvtransfer-ucx-put",
                                        initializer=init)

        self._scratch = torch.empty(_WIREUP_BYTES * len(self._lanes), dtype=torch.uint8,
                                    device=kv.tensor.device)

    async def _on_connected(self, peer: Peer) -> None:
        welcome = peer.welcome
        if not {"ucx_worker", "rkeys", "bases", "nbytes"} <= welcome.keys():
            raise ProtocolError("ucx WELCOME without the receiver's registration")
        if not self._lanes:
            self._open_lanes()
        assert self._ucp is not None
        remote = peer.state = _Remote([int(b) for b in welcome["bases"]],
                                      int(welcome["nbytes"]))
        if self.config.ucx_host_copy and self.kv is not None and not self.kv.is_cuda:
            remote.host = HostCopy.of(welcome.get("node"), remote.bases[0])
        if remote.host is not None:
            return  # copied by this process's lane threads: no UCX endpoint to it
        packed = [bytes.fromhex(str(k)) for k in welcome["rkeys"]]
        for lane in self._lanes:
            ep = lane.connect(str(welcome["ucx_worker"]))
            remote.eps.append(ep)
            remote.rkeys.append([self._ucp.rkey_unpack(ep.handle, k) for k in packed])
        # Wire every lane up now, with a small get into scratch (connect() bounds it),
        # not on the first write's clock.
        n, base = min(_WIREUP_BYTES, remote.nbytes), self._scratch.data_ptr()
        await self._run(remote, "get", [[(base + i * _WIREUP_BYTES, n, remote.bases[0])]
                                        for i in range(len(self._lanes))], scratch=True)

    async def _copy(self, peer: Peer, pairs: Pairs,
                    deadline: float, ready: Ready | None) -> Ready | None:
        assert self.kv is not None
        kv, remote = self.kv, peer.state
        # UCX reads the source itself: the forward that wrote it must be done (its event;
        # without one, all work queued on the compute stream so far).
        await (device_ready(kv.tensor.device, ready) if kv.is_cuda else wait_ready(ready))
        there = rank_layout(kv.layout, len(remote.bases))
        for _, dst in pairs:
            dst.check(there, remote.nbytes // there.block_bytes, len(remote.bases))
        # Head slices go packed, a tile per put (on the host; a device cache has no
        # numpy view, so its slices go run by run).
        packed, pairs = ([], pairs) if kv.is_cuda else \
            bounce.tiles(pairs, kv.rank_layout, there, _BOUNCE_BYTES)
        groups = put_rows(kv, pairs, remote.bases, remote.nbytes)
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout("ucx grant expired before the puts")

        async def put_all() -> None:
            # Every (source rank, destination rank) group and the packed tiles at once:
            # one group's flush round trip overlaps the others' puts. Every group ends
            # before an error is raised (no lane thread outlives the call on a peer
            # that then goes).
            lanes = len(self._lanes)
            done = await asyncio.gather(self._put_tiles(remote, packed, there, deadline), *(
                self._run(remote, "put", plan_lanes(items, lanes), src_rank=src_rank,
                          dst_rank=dst_rank, bound=deadline)
                for (src_rank, dst_rank), items in groups.items()), return_exceptions=True)
            for result in done:
                if isinstance(result, BaseException):
                    raise result

        # Busy for the whole copy, not per batch: a disconnect waits for it (between
        # batches, while a tile is packed, nothing else shows it is not done).
        remote.busy += 1
        # the puts may run until the copy budget past the start bound (`grants`)
        puts = asyncio.ensure_future(asyncio.wait_for(put_all(), left + self.config.copy_budget_s))
        try:
            # A cancelled write ends only once its puts did (then stopped if need be),
            # however often it is cancelled: its revoked grant may then be given back
            # (`InPlaceSender._copy`).
            cancelled = await _to_the_end(puts)
            error = None if puts.cancelled() else puts.exception()
            if isinstance(error, asyncio.TimeoutError):
                cancelled |= await _to_the_end(asyncio.ensure_future(
                    self._stop_puts(peer, remote, left)))
                error = TransferTimeout(f"ucx puts not flushed within the grant ({left:.1f}s "
                                        "and its copy budget)")
            if isinstance(error, PeerUnavailable):  # its memory or endpoints are gone
                self._fail_peer(peer, error)
            if error is not None:
                raise error
            if cancelled:
                raise asyncio.CancelledError
        finally:
            remote.busy -= 1
        return None  # flushed: the bytes are in place

    async def _stop_puts(self, peer: Peer, remote: _Remote, left: float) -> None:
        """Puts past the copy budget: the peer fails, no batch issues any more, and its
        endpoints are closed (their puts still outstanding cancelled or completed)
        before the write reports its end: the receiver may reuse the cells soon after."""
        self._fail_peer(peer, TransferTimeout(
            f"ucx puts not flushed within the grant ({left:.1f}s)"))
        remote.close()
        if remote.issuing:  # lane threads issue without blocking: they return soon
            await asyncio.wait(set(remote.issuing))
        self._close_endpoints(remote)

    def _close_endpoints(self, remote: _Remote) -> None:
        assert self._ucp is not None
        for rkeys in remote.rkeys:
            for rkey in rkeys:
                self._ucp.rkey_destroy(rkey)
        remote.rkeys = []
        for ep in remote.eps:
            close_endpoint(ep)
        remote.eps = []

    async def _put_tiles(self, remote: _Remote, tiles: list[bounce.Tile],
                         there: KVLayout, bound: float) -> None:
        """Each packed tile of `tiles` one put into its region (`bounce.Packer`)."""
        if not tiles:
            return
        assert self.kv is not None and self._ucp is not None
        lanes = len(self._lanes)

        async def put(memhs: list[int], rows: dict[int, list[tuple[int, int, int]]]) -> None:
            done = await asyncio.gather(*(
                self._run(remote, "put", plan_lanes(items, lanes), dst_rank=rank,
                          memhs=memhs, bound=bound) for rank, items in rows.items()),
                return_exceptions=True)
            for result in done:
                if isinstance(result, BaseException):
                    raise result

        if remote.packer is None:
            remote.packer = bounce.Packer(_BOUNCE_BYTES)
            self._packers.add(remote.packer)
        await remote.packer.put(self.kv, tiles, there, remote.bases, put, self._ucp,
                               [lane.context.handle for lane in self._lanes], owner=remote)

    async def _run(self, remote: _Remote, op: str, plan: Sequence[Any],
                   scratch: bool = False, src_rank: int = 0, dst_rank: int = 0,
                   memhs: list[int] | None = None, bound: float | None = None) -> None:
        """Each lane issues its list (from its own thread), then flushes; returns once
        every lane's flush completed. The local addresses lie in `src_rank`'s cache, or
        in the memory `memhs` (one per lane) registered. PeerUnavailable on a UCX
        error. A receiver on this node is copied into directly (`host_copy`), each
        call started before `bound`."""
        assert self._flushes is not None and self._pool is not None and self._ucp is not None
        loop = asyncio.get_running_loop()
        cuda = self.kv is not None and self.kv.is_cuda
        if remote.closed:  # its keys and endpoints are gone (or going)
            raise PeerUnavailable(f"ucx {op}: the receiver was disconnected")
        if remote.host is not None:  # its issuing set: a disconnect waits for the copies
            return await remote.host.write_lanes(self._pool, plan, bound, remote.issuing)
        waits = []
        remote.busy += 1
        try:
            for lane, parts in enumerate(plan):
                if len(parts) == 0:
                    continue
                fid, done = self._flushes.new()
                waits.append(done)
                issued = loop.run_in_executor(
                    self._pool, self._batches[lane].run, op, remote.eps[lane].handle,
                    remote.rkeys[lane][dst_rank], parts, fid,
                    0 if scratch else memhs[lane] if memhs is not None
                    else self._memhs[lane][src_rank], cuda)
                issued.add_done_callback(functools.partial(self._issued, fid))
                remote.issuing.add(issued)  # outlives this call if it is cancelled
                issued.add_done_callback(remote.issuing.discard)
            for status in await asyncio.gather(*waits):
                if status != 0:
                    raise self._ucp.error(status, f"{op}/flush")
        finally:
            remote.busy -= 1

    def _issued(self, fid: int, issued: asyncio.Future[None]) -> None:
        if issued.exception() is not None and self._flushes is not None:
            self._flushes.resolve(fid, -1)  # UCS_ERR_NO_MESSAGE: the batch was refused

    async def _on_disconnected(self, peer: Peer) -> None:
        remote, peer.state = peer.state, None
        if remote is None:
            return
        remote.close()  # no batch issues from now on
        deadline = time.monotonic() + self.config.io_timeout_s
        # a lane thread may be issuing (also for a batch whose caller was cancelled)
        while (remote.busy or remote.issuing) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._close_endpoints(remote)
        if remote.packer is not None:  # its buffers go once no lane thread may read them
            if remote.issuing:  # a thread past the deadline: freed when it returns
                task = asyncio.ensure_future(self._free_packer(remote))
                self._freeing.add(task)
                task.add_done_callback(self._freeing.discard)
            else:
                await self._free_packer(remote)

    async def _free_packer(self, remote: _Remote) -> None:
        """Unmaps `remote`'s bounce buffers once no lane thread issues to it (a thread
        past the disconnect's deadline returns when its batch does)."""
        packer = remote.packer
        assert packer is not None and self._ucp is not None
        if remote.issuing:
            await asyncio.wait(set(remote.issuing))
        if packer in self._packers:  # not freed by close() meanwhile
            self._packers.discard(packer)
            packer.close(self._ucp)

    def _close_memory(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._ucp is not None:
            for lane, memhs in zip(self._lanes, self._memhs, strict=True):
                for memh in memhs:
                    self._ucp.mem_unmap(lane.context.handle, memh)
            for packer in self._packers:  # the pool is shut down: no thread reads them
                packer.close(self._ucp)
            self._packers.clear()
        self._memhs.clear()
        self._batches.clear()
        self._scratch = None  # device memory on a GPU: nothing outlives close()
        close_lanes(self._lanes)


async def _to_the_end(task: asyncio.Future[Any]) -> bool:
    """Waits until `task` is done, through cancellations: True if there were any."""
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


__all__ = ["UcxReceiver", "UcxSender"]
