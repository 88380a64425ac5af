"""Registered KV memory: a block-major torch tensor seen as flat bytes.

Transports move bytes, so both sides take a byte view of the whole cache once, at
registration, and slice regions out of it without copying.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import torch
import xxhash

from kvtransfer.layout import KVLayout, Region

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


class RegisteredKV:
    """The local KV cache, registered once with a transport.

    Holds a reference to the tensor (the engine owns it; it must outlive the
    transport). `view()` gives writable memoryviews into host memory; for CUDA
    tensors `device_slice()` gives the byte slice on the device (for UCX).
    """

    def __init__(self, kv: torch.Tensor, layout: KVLayout) -> None:
        self.layout = layout
        self.num_blocks = check_kv_tensor(kv, layout)
        self.tensor = kv
        self.is_cuda = kv.is_cuda
        self.bytes = kv.view(-1).view(torch.uint8)
        self._host: memoryview | None = None
        if not self.is_cuda:
            self._host = host_bytes(self.bytes)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes

    @property
    def address(self) -> int:
        """Base address of the cache (host or device): what RMA registers."""
        return int(self.tensor.data_ptr())

    def locate(self, region: Region) -> tuple[int, int]:
        """(offset, nbytes) of `region`; ValueError if it lies outside this cache."""
        return region.resolve(self.layout, self.num_blocks)

    def view(self, region: Region) -> memoryview:
        """A writable memoryview of `region` in host memory (no copy)."""
        if self._host is None:
            raise ValueError("host view of a CUDA KV cache; stage it or use ucx")
        off, n = self.locate(region)
        return self._host[off:off + n]

    def device_slice(self, region: Region) -> torch.Tensor:
        off, n = self.locate(region)
        return self.bytes[off:off + n]

    def checksum(self, region: Region) -> int:
        """On CUDA: copied to the host on this thread's current stream, behind the work
        queued there (a sender uses `device_checksums`)."""
        return checksum(self.view(region)) if self._host is not None else \
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


class Ready(Protocol):
    """When a write's source bytes are final. On CUDA, the event the engine recorded
    on its compute stream right after the forward that wrote them (`torch.cuda.Event`,
    `RequestOutput.kv_ready`); None where the bytes are final already (host memory)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


async def wait_ready(ready: Ready | None) -> None:
    """Return once `ready` has completed, without blocking the event loop."""
    if ready is not None and not ready.query():
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
