"""`cuda_ipc`: the device twin of `shm`. Two processes on one node; the prefill writes
straight into the decode's KV cache on the GPU, one batched copy per chunk.

After the authenticated handshake the receiver's WELCOME carries its cache, registered
once and exported for that connection (`Mover.export`); the sender maps it once per
connection (`Mover.open`). Each
`write()` is the in-place writers' protocol (`kvtransfer/inplace.py`: the copy under
the transfer's revocable grant, then its WRITTEN notice), so fencing, generations, leases,
late-write dropping, checksums and metrics are exactly those of `shm` and `ucx`.

The data mover is the only part that differs by device, and is small:

- `CudaMover`: the cache exported as a CUDA IPC handle (torch's `_share_cuda_`, the
  mechanism behind `torch.multiprocessing`); the sender maps it (same GPU, or a P2P /
  NVLink peer) and copies a chunk's blocks, every layer, with ONE launch of the block
  copy kernel (`kvtransfer/copy_kernel.py`) on its own stream. That stream first waits
  on the write's `ready` event, which the engine recorded on the compute stream right
  after the forward that wrote the chunk (`RequestOutput.kv_ready`): ordered by events,
  no device-wide sync, so chunk c's copy runs while chunk c+1's forward, queued after
  that event, computes (layer-wise streaming, one chunk's layers at a time). The write
  returns once the copy is queued; its WRITTEN notice goes out once an event after the
  copy has completed (`InPlaceSender`'s deferred notices), so the decode never sees a
  block as ready before its bytes are on the device, and no chunk waits on the host
  for the copy of the one before.
- `HostMover` (KV caches in host memory, which is how the CPU tests run this same
  protocol): the cache exported as (pid, address); the sender writes a chunk's
  regions with one `process_vm_writev` call per 1024 regions (the kernel's batched
  cross-process copy, what UCX's `cma` uses).

Both need the two processes on one node: WELCOME carries the receiver's boot id and
a sender elsewhere refuses at connect with an error naming `ucx`.

Across the GPUs of one node the receiver's export also names its GPU by UUID, since
device ordinals are per process (CUDA_VISIBLE_DEVICES renumbers them). The sender finds
that GPU among those it sees and maps the handle in its own device's context: CUDA
then enables peer access from the sender's GPU to the receiver's (torch opens IPC
handles with `cudaIpcMemLazyEnablePeerAccess`), and the one copy launch runs on the
sender's GPU, pushing over NVLink / PCIe, ordered after the chunk's event on the same
device. Peer access needs both GPUs visible to the sender: `ipc_refusal` says why a
pair cannot use the path, and `auto` then takes `ucx` for that peer.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

import numpy as np

from kvtransfer import region_rows as rr
from kvtransfer.config import INLINE_COPY_BYTES, TransferConfig
from kvtransfer.copy_kernel import BlockCopy, layer_views, plan_blocks
from kvtransfer.errors import PeerUnavailable, ProtocolError, TransferTimeout
from kvtransfer.inplace import InPlaceReceiver
from kvtransfer.inplace_sender import InPlaceSender
from kvtransfer.layout import Pairs
from kvtransfer.memory import FutureReady, Ready, RegisteredKV, producer_event, wait_ready
from kvtransfer.receiver import Conn
from kvtransfer.sender import Peer

_IOV_MAX = 1024


def boot_id() -> str:
    """This node's identity: two processes share it only on one running kernel."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def gpu_uuid(index: int) -> str:
    """A GPU's identity across processes (ordinals differ between processes)."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def local_gpus() -> dict[str, int]:
    """The GPUs this process sees: UUID -> ordinal."""
    import torch

    return {gpu_uuid(i): i for i in range(torch.cuda.device_count())}


def ipc_refusal(welcome: Mapping[str, Any], *, node: str, kind: str, own_gpu: int | None,
                gpus: Mapping[str, int] | None,
                can_access: Callable[[int, int], bool] | None) -> str | None:
    """Why this sender cannot map the receiver's cache that `welcome` describes, or None
    when it can. `node`: this node's boot id; `kind`: this sender's cache memory ("cuda"
    or "host"); `own_gpu`: its cache's ordinal; `gpus`: UUID -> ordinal of the GPUs it
    sees; `can_access(a, b)`: whether ordinal a can reach ordinal b's memory (peer)."""
    exported = welcome.get("cuda_ipc")
    if not isinstance(exported, dict):
        return "cuda_ipc WELCOME without an exported cache"
    if welcome.get("boot_id") != node:
        return "cuda_ipc needs both workers on one node; between nodes use --transport ucx"
    if exported.get("kind") != kind:
        return (f"cuda_ipc: the receiver's KV cache is in {exported.get('kind')} memory, "
                f"this sender's in {kind} memory; run both workers with one --device, or "
                "use --transport ucx")
    if kind != "cuda":
        return None
    theirs = exported.get("gpu")
    if not isinstance(theirs, str) or gpus is None or own_gpu is None:
        return "cuda_ipc: the receiver's export does not name its GPU"
    if theirs not in gpus:
        return (f"cuda_ipc: the receiver's GPU ({theirs}) is not visible to this sender; "
                "give both workers every GPU of the pair in CUDA_VISIBLE_DEVICES and each "
                "its own --device cuda:N, or use --transport ucx")
    peer = gpus[theirs]
    if peer != own_gpu and (can_access is None or not can_access(own_gpu, peer)):
        return (f"cuda_ipc: GPU cuda:{own_gpu} cannot access cuda:{peer} as a peer (no "
                "NVLink / PCIe P2P between them); use --transport ucx")
    return None


def local_refusal(welcome: Mapping[str, Any], kv: RegisteredKV) -> str | None:
    """`ipc_refusal` for this process and its cache `kv`."""
    if not kv.is_cuda:
        return ipc_refusal(welcome, node=boot_id(), kind="host", own_gpu=None, gpus=None,
                           can_access=None)
    import torch

    own = kv.tensor.device.index
    own = torch.cuda.current_device() if own is None else own
    return ipc_refusal(welcome, node=boot_id(), kind="cuda", own_gpu=own, gpus=local_gpus(),
                       can_access=torch.cuda.can_device_access_peer)


class Mover(Protocol):
    """Moves a chunk's bytes into an exported cache; one implementation per device."""

    kind: str

    def export(self, kv: RegisteredKV) -> dict[str, Any]:
        """Receiver: describe the registered cache for senders (JSON-able, once)."""

    def open(self, exported: dict[str, Any], kv: RegisteredKV) -> Any:
        """Sender: map a receiver's exported cache for copies from `kv`; returns the
        destination handle."""

    def prepare(self, kv: RegisteredKV) -> None:
        """Sender, in a worker thread, before the first copy: set up what a first copy
        would (streams, the kernel loaded), so that no copy waits for the device."""

    async def copy(self, kv: RegisteredKV, dst: Any, pairs: Pairs,
                   deadline: float, ready: Ready | None) -> Ready | None:
        """Copy (src, dst) region pairs from `kv` into `dst`, none before `ready`
        completed; start nothing after `deadline`. Returns None once the bytes are in
        place, or an event that completes when they are. Never blocks the event loop;
        ValueError for a region outside either cache."""

    def close(self, held: list[Any]) -> None:
        """Sender, in a worker thread: unmap the destination `held` holds (its only
        reference: the release may wait for the device)."""


class Mapped:
    """A receiver's cache mapped here (`flat`, its bytes) and the block copy from the
    local cache into it (`BlockCopy`: its per-layer pointer table made once per
    connection). Holds the mapping's only reference."""

    def __init__(self, flat: Any, kv: RegisteredKV) -> None:
        self.flat = flat
        self.num_blocks = int(flat.numel()) // kv.layout.block_bytes
        self.layout = kv.layout
        self.src_blocks = kv.num_blocks
        self.copy = BlockCopy(layer_views(kv.tensor, kv.layout),
                              layer_views(flat[:self.num_blocks * kv.layout.block_bytes],
                                          kv.layout))

    def launch(self, pairs: Pairs, after: Any = None) -> None:
        """Queue the pairs' copy on the current stream, not before `after` completed: one
        launch per layer range (a chunk has one). ValueError for a region outside either
        cache."""
        plan = plan_blocks(pairs, self.layout, self.src_blocks, self.num_blocks)
        for layers, (src_ids, dst_ids) in plan.items():
            self.copy(src_ids, dst_ids, layers, after=after)


class CudaMover:
    """The export is a CUDA IPC handle of the cache's allocation, made with torch's
    `_share_cuda_` on a storage that aliases the cache without owning it. torch parks a
    shared storage in its "limbo" until every consumer has decremented the export's
    reference count, which a sender killed while mapped never does; shared directly, the
    cache would then stay allocated after the engine dropped it. Shared through the
    alias, only the alias waits there (no memory) and the cache is freed with the
    tensor: the engine must keep it (it owns it) until `close()` returned, as for every
    transport; a killed sender's mapping goes with its process.

    Sender side, nothing here waits for the GPU on the event loop: `prepare()` has made
    a first launch at connect time in a worker thread, before any compute is queued (a
    first launch loads the kernel, and loading waits for the work already queued on the
    device, e.g. the next chunk's forward); a copy's launch then queues on the event loop
    without waiting (its block ids go up from pinned memory: `BlockCopy`), and its
    completion is an event the sender's deferred notice waits on (`InPlaceSender`)."""

    kind = "cuda"

    def __init__(self) -> None:
        self._stream: Any = None
        self._prepared = False
        self._launch = threading.Lock()  # one launch at a time (Triton's cache, the stream)

    def export(self, kv: RegisteredKV) -> dict[str, Any]:
        import torch

        t = kv.tensor
        storage = t.untyped_storage()
        alias = torch._C._construct_storage_from_data_pointer(
            storage.data_ptr(), t.device, storage.nbytes())
        (device, handle, size, offset, ref_handle, ref_offset, event_handle,
         event_sync) = alias._share_cuda_()  # type: ignore[attr-defined]
        return {"device": int(device), "handle": bytes(handle).hex(), "size": int(size),
                "offset": int(offset), "ref_handle": bytes(ref_handle).hex(),
                "ref_offset": int(ref_offset),
                "event_handle": bytes(event_handle or b"").hex(),
                "event_sync": bool(event_sync),
                "tensor_offset": t.storage_offset() * t.element_size(), "nbytes": kv.nbytes,
                "gpu": gpu_uuid(int(device))}

    def open(self, exported: dict[str, Any], kv: RegisteredKV) -> Any:
        """Maps the handle in the context of the sender's own GPU (the receiver's
        ordinal means nothing here): on another GPU, CUDA enables peer access to the
        receiver's at this open, and the mapping is addressable by kernels launched on
        the sender's GPU, where `copy` launches."""
        import torch

        e = exported
        own = kv.tensor.device.index
        own = torch.cuda.current_device() if own is None else own
        storage = torch.UntypedStorage._new_shared_cuda(
            own, bytes.fromhex(e["handle"]), e["size"], e["offset"],
            bytes.fromhex(e["ref_handle"]), e["ref_offset"],
            bytes.fromhex(e["event_handle"]) or None, e["event_sync"])
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{own}")
        flat.set_(storage, e["tensor_offset"], (e["nbytes"],), (1,))
        return Mapped(flat, kv)

    def prepare(self, kv: RegisteredKV) -> None:
        """One real launch of the copy kernel, block 0 into a scratch block: loads the
        variant every later copy uses (the same word, alignment and strides), allocates
        on the copy stream and the pinned id buffers."""
        import torch

        device = kv.tensor.device
        with self._launch, torch.cuda.device(device):
            if self._prepared:
                return
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            with torch.cuda.stream(self._stream):
                scratch = torch.empty(kv.layout.block_bytes, dtype=torch.uint8, device=device)
                BlockCopy(layer_views(kv.tensor, kv.layout),
                          layer_views(scratch, kv.layout))([0], [0])
            self._stream.synchronize()
            self._prepared = True

    async def copy(self, kv: RegisteredKV, dst: Any, pairs: Pairs,
                   deadline: float, ready: Ready | None) -> Ready | None:
        # The producer event is taken here: the compute stream is this thread's.
        produced = producer_event(kv.tensor.device, ready)
        return self._launch_copy(kv, dst, pairs, deadline, produced)

    def _launch_copy(self, kv: RegisteredKV, dst: Mapped, pairs: Pairs,
                     deadline: float, produced: Any) -> Any:
        """Queue the chunk's copy on the copy stream, after `produced` (one launch per
        layer range: one for a chunk); returns the event after it."""
        import torch

        device = kv.tensor.device
        with self._launch, torch.cuda.device(device):
            if time.monotonic() >= deadline:
                raise TransferTimeout("cuda_ipc grant expired before the copy")
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            with torch.cuda.stream(self._stream):
                dst.launch(pairs, after=produced)
                copied = torch.cuda.Event()
                copied.record(self._stream)
        return copied

    def close(self, held: list[Any]) -> None:
        # No copy may still write through the mapping when it goes; it goes with the last
        # reference to its storage (torch's release synchronizes this thread's current
        # stream first: hence a worker thread, not the event loop's).
        if self._stream is not None:
            self._stream.synchronize()
        held.clear()


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class HostMover:
    """Copies run on one thread of their own, in order (a host twin of the copy
    stream): `copy` returns at once with the copy's future, which the sender's deferred
    notice waits on (`InPlaceSender`). A copy of at most `inline_bytes` with none queued
    before it runs on the caller's thread instead and `copy` returns None, its bytes in
    place: the hop to the copy thread and the wake-up back cost more than such a copy
    (`bench transfer --handoffs` measures the hand-off's fixed cost)."""

    kind = "host"

    def __init__(self, inline_bytes: int = INLINE_COPY_BYTES) -> None:
        self.inline_bytes = inline_bytes
        libc = ctypes.CDLL(None, use_errno=True)
        self._writev = libc.process_vm_writev
        self._writev.restype = ctypes.c_ssize_t
        self._writev.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                 ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cuda-ipc-host-copy")
        self._last: Future[None] | None = None

    def export(self, kv: RegisteredKV) -> dict[str, Any]:
        return {"pid": os.getpid(), "address": kv.address, "nbytes": kv.nbytes}

    def open(self, exported: dict[str, Any], kv: RegisteredKV) -> Any:
        return (int(exported["pid"]), int(exported["address"]),
                int(exported["nbytes"]) // kv.layout.block_bytes)

    def prepare(self, kv: RegisteredKV) -> None:
        pass

    async def copy(self, kv: RegisteredKV, dst: Any, pairs: Pairs,
                   deadline: float, ready: Ready | None) -> Ready | None:
        regions = self._regions(kv, pairs, dst[2])
        await wait_ready(ready)
        if time.monotonic() >= deadline:
            raise TransferTimeout("cuda_ipc grant expired before the copy")
        if (self._last is None or self._last.done()) \
                and int(regions[:, 2].sum()) <= self.inline_bytes:
            self._copy(kv.address, dst, regions, deadline)  # in order: none is queued
            return None
        self._last = self._pool.submit(self._copy, kv.address, dst, regions, deadline)
        return FutureReady(self._last)

    @staticmethod
    def _regions(kv: RegisteredKV, pairs: Pairs, total: int) -> np.ndarray:
        """(source offset, destination offset, nbytes) of every pair; ValueError for a
        region outside either cache or a head slice."""
        src_rows = rr.side_rows(pairs, "src", kv.layout)
        dst_rows = rr.side_rows(pairs, "dst", kv.layout)
        rr.check_rows(src_rows, kv.layout, kv.num_blocks)
        rr.check_rows(dst_rows, kv.layout, total)
        if len(src_rows) <= rr.FEW:  # on plain ints
            here, there = rr.byte_ranges(src_rows, kv.layout), rr.byte_ranges(dst_rows, kv.layout)
            if here is not None and there is not None:
                return np.array([(s, d, n) for (_, s, n), (_, d, _) in
                                 zip(here, there, strict=True)], dtype=np.int64).reshape(-1, 3)
        elif (rr.whole_heads(src_rows, kv.layout) & rr.whole_heads(dst_rows, kv.layout)).all():
            return np.stack([rr.offsets(src_rows, kv.layout), rr.offsets(dst_rows, kv.layout),
                             rr.nbytes(src_rows, kv.layout)], axis=1)
        raise ValueError("cuda_ipc moves whole-head regions (one rank each side)")

    def _copy(self, src: int, dst: tuple[int, int, int], regions: np.ndarray,
              deadline: float) -> None:
        """Runs on the pool's thread, perhaps after copies queued before it: each batch
        of iovecs starts only while the grant holds (past it the receiver may have
        given the blocks to another request)."""
        pid, base, _ = dst
        # iovec arrays built by numpy: (base, len) as two uint64 words per region
        local = np.stack([regions[:, 0] + src, regions[:, 2]], axis=1).astype(np.uint64)
        remote = np.stack([regions[:, 1] + base, regions[:, 2]], axis=1).astype(np.uint64)
        iovecs = ctypes.POINTER(_IoVec)
        for i in range(0, len(regions), _IOV_MAX):
            if time.monotonic() >= deadline:
                raise TransferTimeout("cuda_ipc grant expired before the copy")
            n = min(_IOV_MAX, len(regions) - i)
            want = int(regions[i:i + n, 2].sum())
            done = self._writev(pid, local[i:].ctypes.data_as(iovecs), n,
                                remote[i:].ctypes.data_as(iovecs), n, 0)
            if done != want:  # a short write only happens on a fault (pages gone)
                err = ctypes.get_errno()
                raise PeerUnavailable(f"process_vm_writev to {pid}: {done}/{want} bytes "
                                      f"({os.strerror(err) if done < 0 else 'short'})")

    def close(self, held: list[Any]) -> None:
        if self._last is not None:  # no copy into the peer after it was let go
            wait([self._last])
        held.clear()


def mover_for(kv: RegisteredKV, config: TransferConfig) -> Mover:
    return CudaMover() if kv.is_cuda else HostMover(config.inline_copy_bytes)


class CudaIpcReceiver(InPlaceReceiver):
    name = "cuda_ipc"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._exported: dict[str, Any] = {}
        self._mover: Mover = HostMover()

    async def start(self) -> None:
        assert self.kv is not None, "register() the KV cache first"
        self._mover = mover_for(self.kv, self.config)
        self._exported = {"boot_id": boot_id()}
        await super().start()

    async def _welcome(self, conn: Conn, hello: dict[str, Any]) -> dict[str, Any]:
        # After the token proof: only members of the cluster may map the cache. One
        # export per connection: torch counts each CUDA IPC share's consumer once.
        assert self.kv is not None
        exported = {"kind": self._mover.kind, **self._mover.export(self.kv)}
        return {**await super()._welcome(conn, hello), **self._exported,
                "cuda_ipc": exported}


class CudaIpcSender(InPlaceSender):
    name = "cuda_ipc"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mover: Mover | None = None

    async def _on_connected(self, peer: Peer) -> None:
        assert self.kv is not None
        refusal = local_refusal(peer.welcome, self.kv)
        if refusal is not None:
            raise ProtocolError(refusal)
        if self._mover is None:
            self._mover = mover_for(self.kv, self.config)
        peer.state = self._mover.open(peer.welcome["cuda_ipc"], self.kv)
        await asyncio.to_thread(self._mover.prepare, self.kv)

    async def _copy(self, peer: Peer, pairs: Pairs,
                    deadline: float, ready: Ready | None) -> Ready | None:
        assert self.kv is not None and self._mover is not None
        return await self._mover.copy(self.kv, peer.state, pairs, deadline, ready)

    async def _on_disconnected(self, peer: Peer) -> None:
        held, peer.state = [peer.state], None
        if held[0] is not None and self._mover is not None:
            await asyncio.to_thread(self._mover.close, held)


__all__ = ["CudaIpcReceiver", "CudaIpcSender", "CudaMover", "HostMover", "boot_id",
           "gpu_uuid", "ipc_refusal", "local_gpus", "local_refusal"]
