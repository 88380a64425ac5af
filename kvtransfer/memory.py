"""Registered KV memory: a block-major torch tensor seen as flat bytes.

Transports move bytes, so both sides take a byte view of the whole cache once, at
registration, and slice regions out of it without copying.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch
import xxhash

from kvtransfer.layout import KVLayout, Region, rank_layout

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16, "float8_e4m3fn": torch.float8_e4m3fn}


def torch_dtype(layout: KVLayout) -> torch.dtype:
    return _TORCH_DTYPES[layout.dtype]


def check_kv_tensor(kv: torch.Tensor, layout: KVLayout) -> int:
    """Validate `kv` against `layout`; returns num_blocks. ValueError explains a mismatch."""
    if kv.dtype != torch_dtype(layout):
        raise ValueError(f"KV tensor dtype {kv.dtype} does not match layout {layout.dtype}")
    if kv.dim() != 6 or tuple(kv.shape[1:]) != layout.tensor_shape(1)[1:]:
        raise ValueError(f"KV tensor shape {tuple(kv.shape)} does not match "
                         f"{layout.tensor_shape(kv.shape[0] if kv.dim() else 0)}")
    if not kv.is_contiguous():
        raise ValueError("KV tensor must be contiguous (block-major)")
    return int(kv.shape[0])


@dataclass(frozen=True, slots=True)
class RankCaches:
    """A tensor-parallel worker's KV caches, one per rank (rank 0's first), each
    holding that rank's KV heads of every block under the same block ids; `names`:
    their shared-memory segments, where they are in named ones (the `shm` receiver
    hands them to senders)."""

    tensors: list[torch.Tensor]
    names: list[str] | None = None


class RegisteredKV:
    """The local KV cache, registered once with a transport: one block-major tensor,
    or (`RankCaches`) one per tensor-parallel rank, each with its heads.

    Holds references to the tensors (the engine owns them; they must outlive the
    transport). `view()` gives writable memoryviews into host memory; for CUDA
    tensors `device_slice()` gives the byte slice on the device (for UCX). A region
    names its rank; a head slice of a rank's cache (strided) is read with `payload`
    and written with `unpack`.
    """

    def __init__(self, kv: torch.Tensor | RankCaches, layout: KVLayout) -> None:
        tensors = kv.tensors if isinstance(kv, RankCaches) else [kv]
        self.layout = layout  # the model's: every KV head (what the handshake checks)
        self.tp = len(tensors)
        self.rank_layout = rank_layout(layout, self.tp)  # one rank's cache
        self.num_blocks = check_kv_tensor(tensors[0], self.rank_layout)
        for t in tensors[1:]:
            if check_kv_tensor(t, self.rank_layout) != self.num_blocks:
                raise ValueError("every rank's KV cache must hold the same blocks")
        self.tensors = tensors
        self.tensor = tensors[0]
        self.is_cuda = self.tensor.is_cuda
        self.rank_bytes = [t.view(-1).view(torch.uint8) for t in tensors]
        self.bytes = self.rank_bytes[0]
        self._hosts: list[memoryview] | None = None
        if not self.is_cuda:
            self._hosts = [host_bytes(b) for b in self.rank_bytes]

    @property
    def nbytes(self) -> int:
        """Bytes of one rank's cache."""
        return self.num_blocks * self.rank_layout.block_bytes

    @property
    def address(self) -> int:
        """Base address of rank 0's cache (host or device): what RMA registers."""
        return int(self.tensor.data_ptr())

    def check(self, region: Region) -> None:
        """ValueError if `region` lies outside the rank caches."""
        region.check(self.rank_layout, self.num_blocks, self.tp)

    def locate(self, region: Region) -> tuple[int, int]:
        """(offset, nbytes) of `region` in its rank's cache; ValueError if it lies
        outside it or is a head slice (no one byte range)."""
        if not 0 <= region.rank < self.tp:
            raise ValueError(f"{region} names a rank of {self.tp}")
        return region.resolve(self.rank_layout, self.num_blocks)

    def region_bytes(self, region: Region) -> int:
        return region.nbytes(self.rank_layout)

    def contiguous(self, region: Region) -> bool:
        return region.whole_heads(self.rank_layout)

    def view(self, region: Region) -> memoryview:
        """A writable memoryview of `region` in host memory (no copy)."""
        if self._hosts is None:
            raise ValueError("host view of a CUDA KV cache; stage it or use ucx")
        off, n = self.locate(region)
        return self._hosts[region.rank][off:off + n]

    def rank_view(self, rank: int) -> memoryview:
        """A writable memoryview of one rank's whole host cache (no copy)."""
        if self._hosts is None:
            raise ValueError("host view of a CUDA KV cache; stage it or use ucx")
        return self._hosts[rank]

    def tensor_of(self, region: Region) -> torch.Tensor:
        """`region` of its rank's cache as a (strided) tensor view."""
        return region_view(self.tensors[region.rank], region, self.rank_layout)

    def host_array(self, region: Region) -> np.ndarray:
        """`region` of a host cache as a strided numpy array of its bytes (numpy copies
        strided runs at memory speed; torch's CPU strided copy runs an order of
        magnitude slower on a loaded few-core host)."""
        return byte_array(self.tensors[region.rank], region, self.rank_layout)

    def payload(self, region: Region) -> memoryview:
        """`region`'s bytes in host memory: a view of the cache, or for a head slice
        its runs packed in order (one copy)."""
        if self.contiguous(region):
            return self.view(region)
        if self.is_cuda:
            return host_bytes(self.tensor_of(region).contiguous().cpu())
        return np.ascontiguousarray(self.host_array(region)).reshape(-1).data

    def payload_parts(self, region: Region, max_bytes: int) -> Iterator[memoryview]:
        """`payload(region)` a few whole blocks at a time (at most `max_bytes`, at least
        one block): a head slice packed in pieces that stay in the CPU's cache."""
        if self.contiguous(region):
            yield self.view(region)
            return
        for part in block_parts(region, self.region_bytes(region), max_bytes):
            yield self.payload(part)

    def unpack(self, region: Region, data: Any) -> None:
        """Writes packed bytes (`payload`'s order) into `region` of a host cache."""
        out = self.host_array(region)
        np.copyto(out, np.frombuffer(data, dtype=np.uint8).reshape(out.shape))

    def device_slice(self, region: Region) -> torch.Tensor:
        off, n = self.locate(region)
        return self.rank_bytes[region.rank][off:off + n]

    def checksum(self, region: Region) -> int:
        """Of `payload`'s bytes. On CUDA: copied to the host on this thread's current
        stream, behind the work queued there (a sender uses `device_checksums`)."""
        return checksum(self.payload(region)) if self._hosts is not None else \
            checksum(host_bytes(self.device_slice(region).cpu()))

    def device_checksums(self, regions: list[Region], after: Any) -> list[int]:
        """Checksums of CUDA regions read on a side stream once the CUDA event `after`
        completed, not behind later work on the compute stream. Blocks until the bytes
        are on the host: call it from a worker thread."""
        device = self.tensor.device
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            stream.wait_event(after)
            with torch.cuda.stream(stream):
                return [checksum(host_bytes(self.device_slice(r).cpu())) for r in regions]


def block_parts(region: Region, nbytes: int, max_bytes: int) -> list[Region]:
    """`region` (of `nbytes`) cut into runs of whole blocks of at most `max_bytes` (at
    least one block each), in order."""
    per_block = nbytes // region.num_blocks
    k = max(1, max_bytes // per_block)
    return [replace(region, block_id=region.block_id + i,
                    num_blocks=min(k, region.num_blocks - i))
            for i in range(0, region.num_blocks, k)]


def region_view(cache: torch.Tensor, region: Region, layout: KVLayout) -> torch.Tensor:
    """`region` of one rank's block-major cache `cache` (whose heads `layout` counts)
    as a tensor view: [blocks, layers, parts, block_size, heads, head_dim]."""
    start, end = region.layers(layout)
    first, last = region.heads(layout)
    b = region.block_id
    return cache[b:b + region.num_blocks, start:end, :, :, first:last]


def byte_array(cache: torch.Tensor, region: Region, layout: KVLayout) -> np.ndarray:
    """`region` of one rank's host cache as a strided numpy array of bytes:
    [blocks, layers, parts, block_size, heads, head_dim * itemsize]."""
    return region_view(cache.view(torch.uint8), region, layout).numpy()


def byte_runs(src: torch.Tensor, dst: torch.Tensor) -> np.ndarray:
    """The contiguous runs that copy view `src` into view `dst` (same shape): an int64
    array of rows (source offset, destination offset, nbytes), offsets in bytes from
    each one's storage start, in `src`'s element order. One row where both are
    contiguous; else one per (block, layer, part, token) (heads x head_dim is contiguous
    in both), with neighbours that are contiguous on both sides merged into one row.

    Offsets come from numpy arithmetic over the index grid (a head slice of a 2048-token
    prompt is ~10^5 runs: a Python loop over them costs seconds)."""
    if src.shape != dst.shape:
        raise ValueError(f"byte_runs of shapes {tuple(src.shape)} and {tuple(dst.shape)}")
    size = src.element_size()
    if src.is_contiguous() and dst.is_contiguous():
        return np.array([[src.storage_offset() * size, dst.storage_offset() * size,
                          src.numel() * size]], dtype=np.int64)
    run = src.shape[-1] * src.shape[-2] * size
    s, d = _grid_offsets(src) * size, _grid_offsets(dst) * size
    if s.size == 0 or run == 0:
        return np.empty((0, 3), dtype=np.int64)
    # | run i | run i+1 |: one row where run i+1 follows run i on both sides
    joined = (s[1:] == s[:-1] + run) & (d[1:] == d[:-1] + run)
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    lengths = np.diff(np.append(starts, s.size)) * run
    return np.stack([s[starts], d[starts], lengths], axis=1)


def _grid_offsets(t: torch.Tensor) -> np.ndarray:
    """Element offsets (from the storage start) of each index of `t`'s leading dims
    (all but the last two), flattened in C order."""
    off = np.array(t.storage_offset(), dtype=np.int64)
    for n, stride in zip(t.shape[:-2], t.stride()[:-2], strict=False):
        off = off[..., None] + np.arange(n, dtype=np.int64) * stride
    return off.reshape(-1)


class Ready(Protocol):
    """When a write's source bytes are final. On CUDA, the event the engine recorded
    on its compute stream right after the forward that wrote them (`torch.cuda.Event`,
    `RequestOutput.kv_ready`); None where the bytes are final already (host memory)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class FutureReady:
    """A copy running on a thread of the host (`concurrent.futures.Future`) as `Ready`;
    `wait_ready` awaits it without a thread of its own."""

    def __init__(self, future: Future[None]) -> None:
        self.future = future

    def query(self) -> bool:
        return self.future.done()

    def synchronize(self) -> None:
        self.future.result()


async def wait_ready(ready: Ready | None) -> None:
    """Return once `ready` has completed, without blocking the event loop; raises what
    its work raised. A host copy's future wakes the loop itself; anything else (a CUDA
    event) is waited for on a worker thread."""
    if ready is None or ready.query():
        return
    if isinstance(ready, FutureReady):
        # shielded: a waiter cancelled (a disconnect) leaves a queued copy to run
        await asyncio.shield(asyncio.wrap_future(ready.future))
    else:
        await asyncio.to_thread(ready.synchronize)


def producer_event(device: torch.device, ready: Ready | None) -> Any:
    """The CUDA event a side stream waits on before reading a write's source bytes:
    `ready` when it is one, else an event after the work queued so far on `device`'s
    current stream (this thread's: take it on the thread that queued the work)."""
    if isinstance(ready, torch.cuda.Event):
        return ready
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


async def device_ready(device: torch.device, ready: Ready | None = None) -> None:
    """Wait, without blocking the event loop, until `ready` completed or, without one,
    the work queued so far on `device`'s current stream. An event, not a device-wide
    sync: work on other streams (or queued after `ready`) is not waited for."""
    if ready is None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        ready = event
    await wait_ready(ready)


def host_bytes(t: torch.Tensor) -> memoryview:
    """Flat writable byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    return t.view(-1).view(torch.uint8).numpy().data.cast("B")


def checksum(data: Any) -> int:
    """xxh3-64 of a region's bytes: fast enough (>10 GB/s) to leave on in tests."""
    return int(xxhash.xxh3_64_intdigest(data))
