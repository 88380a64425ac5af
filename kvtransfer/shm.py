"""`shm`: same host; the receiver's KV cache lives in a POSIX shared-memory segment
that the sender maps and writes directly (one copy, no socket in the data path).
Fencing is the in-place writers' revocable grant (`kvtransfer/inplace.py`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import time
from typing import Any

import numpy as np
import torch

from engine.rank_segments import reserve
from kvtransfer import region_rows as rr
from kvtransfer.copy_kernel import staged_regions
from kvtransfer.errors import PeerUnavailable, TransferTimeout
from kvtransfer.inplace import InPlaceReceiver
from kvtransfer.inplace_sender import InPlaceSender
from kvtransfer.layout import KVLayout, Pairs, rank_layout
from kvtransfer.memory import (
    RankCaches,
    Ready,
    byte_array,
    host_bytes,
    torch_dtype,
    wait_ready,
)
from kvtransfer.receiver import Conn
from kvtransfer.sender import Peer

SHM_DIR = "/dev/shm"  # where Linux's shm_open keeps POSIX segments
_ROWS_PER_CHECK = 256  # byte ranges copied between two looks at a grant's deadline


class SharedKV:
    """A KV cache in a named POSIX shared-memory segment, created by the receiver.

    `tensor` is the block-major KV tensor backed by the segment; the engine uses it
    as its cache. `close()` unlinks the name (mappings stay valid until dropped).
    """

    def __init__(self, name: str, layout: KVLayout, num_blocks: int) -> None:
        self.name = name
        self.nbytes = num_blocks * layout.block_bytes
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            reserve(fd, self.nbytes, name)
            self._map = mmap.mmap(fd, self.nbytes)
        except BaseException:
            os.unlink(os.path.join(SHM_DIR, name))
            raise
        finally:
            os.close(fd)
        flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self.tensor = flat.view(torch_dtype(layout)).view(layout.tensor_shape(num_blocks))

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name))


def allocate_shared_kv(layout: KVLayout, num_blocks: int,
                       name: str | None = None) -> tuple[torch.Tensor, SharedKV]:
    """Allocate a zeroed KV cache in shared memory: (tensor, handle to close later)."""
    shared = SharedKV(name or f"splitserve-kv-{os.getpid()}-{secrets.token_hex(4)}",
                      layout, num_blocks)
    return shared.tensor, shared


def reap_orphaned_segments() -> list[str]:
    """Unlink segments whose creating process is gone (a receiver killed by SIGKILL
    cannot unlink its own). Names carry the creator's pid, so run it only where every
    process that may hold one shares this PID namespace (a process in another one looks
    gone): workers do not run it themselves."""
    reaped = []
    for entry in os.listdir(SHM_DIR):
        parts = entry.split("-")
        if len(parts) != 4 or parts[:2] != ["splitserve", "kv"] or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, entry))
            reaped.append(entry)
        except PermissionError:
            pass  # alive, another user's
    return reaped


class ShmReceiver(InPlaceReceiver):
    """Hands senders the names of its cache's segments: one, or one per rank of a
    tensor-parallel worker (`RankCaches` with names: the engine's rank segments)."""

    name = "shm"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shared: SharedKV | None = None
        self._names: list[str] = []

    def allocate(self, layout: KVLayout, num_blocks: int) -> torch.Tensor:
        """Create the shared KV cache and register it; returns the engine's KV tensor."""
        kv, shared = allocate_shared_kv(layout, num_blocks, self.config.shm_name)
        self.register_shared(shared, layout)
        return kv

    def register_shared(self, shared: SharedKV, layout: KVLayout) -> None:
        self.shared = shared
        self._names = [shared.name]
        super().register(shared.tensor, layout)

    def register(self, kv: Any, layout: KVLayout) -> None:
        if isinstance(kv, RankCaches) and kv.names is not None:
            self._names = list(kv.names)
        elif self.shared is None or kv is not self.shared.tensor:
            raise ValueError("shm needs its KV cache in shared memory: use allocate(), "
                             "register_shared(allocate_shared_kv(...)) or RankCaches with "
                             "segment names")
        super().register(kv, layout)

    async def _welcome(self, conn: Conn, hello: dict[str, Any]) -> dict[str, Any]:
        assert self.kv is not None
        return {"shm_names": self._names, "shm_bytes": self.kv.nbytes}

    def _close_memory(self) -> None:
        super()._close_memory()
        if self.shared is not None:
            self.shared.close()


class ShmSender(InPlaceSender):
    name = "shm"

    async def _on_connected(self, peer: Peer) -> None:
        """Maps every segment of the receiver (one per rank): its rank caches."""
        assert self.kv is not None
        names = [str(n) for n in peer.welcome["shm_names"]]
        nbytes = int(peer.welcome["shm_bytes"])
        layout = rank_layout(self.kv.layout, len(names))
        maps: list[mmap.mmap] = []
        caches = []
        try:
            for name in names:
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
                try:
                    maps.append(mmap.mmap(fd, nbytes))
                finally:
                    os.close(fd)
                caches.append(torch.frombuffer(maps[-1], dtype=torch.uint8).view(
                    torch_dtype(layout)).view(layout.tensor_shape(nbytes // layout.block_bytes)))
        except BaseException:
            # torch.frombuffer takes no buffer export: the mappings close under the views,
            # which must not be used after (they are dropped here, unused)
            del caches
            for m in maps:
                with contextlib.suppress(BufferError):
                    m.close()
            raise
        # the byte views a copy writes through, made once: a write's copy takes them as
        # they are (building them costs tens of µs per write, most of a small one's copy)
        peer.state = (maps, caches, layout, [host_bytes(c) for c in caches])

    async def _copy(self, peer: Peer, pairs: Pairs,
                    deadline: float, ready: Ready | None) -> Ready | None:
        assert self.kv is not None
        await wait_ready(ready)
        if peer.state is None:  # disconnected while the source was being readied
            raise PeerUnavailable("shm peer disconnected before the copy")
        # No await from here to the return: _on_disconnected runs on this loop, so it
        # cannot unmap the segments while this copy writes through them.
        _, caches, layout, views = peer.state
        total = caches[0].shape[0]
        # A CUDA cache's regions come over to the host a batch of blocks at a time
        if time.monotonic() >= deadline:
            raise TransferTimeout("shm grant expired before the copy")
        src_rows = rr.side_rows(pairs, "src", self.kv.rank_layout)
        dst_rows = rr.side_rows(pairs, "dst", layout)
        rr.check_rows(dst_rows, layout, total, len(caches))
        if not self.kv.is_cuda:
            here = rr.byte_ranges(src_rows, self.kv.rank_layout)
            there = rr.byte_ranges(dst_rows, layout)
            if here is not None and there is not None:  # one memcpy per region
                self._copy_ranges(views, here, there, deadline)
                return None
        staged = staged_regions(self.kv.tensor, self.kv.layout, [s for s, _ in pairs]) \
            if self.kv.is_cuda else None
        for src, dst in pairs:
            if time.monotonic() >= deadline:
                raise TransferTimeout("shm grant expired before the copy")
            out = byte_array(caches[dst.rank], dst, layout)
            # one strided copy from the source rank's cache into the destination rank's
            if staged is None:
                np.copyto(out, self.kv.host_array(src))
            else:
                np.copyto(out, next(staged).cpu().numpy().reshape(out.shape))
        return None

    def _copy_ranges(self, there: list[memoryview], src: list[tuple[int, int, int]],
                     dst: list[tuple[int, int, int]], deadline: float) -> None:
        """Byte ranges (`region_rows.byte_ranges`) of the local host cache into the
        mapped caches' byte views `there`, every one checked first; the grant checked
        every _ROWS_PER_CHECK ranges, as the per-pair path checks each pair."""
        assert self.kv is not None
        for (_, _, n), (_, _, m) in zip(src, dst, strict=True):
            if n != m:
                raise ValueError(f"a source range of {n} bytes into one of {m}")
        here = [self.kv.rank_view(r) for r in range(self.kv.tp)]
        for i, ((s_rank, s, n), (d_rank, d, _)) in enumerate(zip(src, dst, strict=True)):
            if i % _ROWS_PER_CHECK == 0 and time.monotonic() >= deadline:
                raise TransferTimeout("shm grant expired before the copy")
            there[d_rank][d:d + n] = here[s_rank][s:s + n]

    async def _on_disconnected(self, peer: Peer) -> None:
        if peer.state is not None:
            maps, caches, _, views = peer.state
            peer.state = None
            # torch.frombuffer takes no buffer export, so the mappings close with the
            # cache tensors still alive: a write through one would fault. Nothing keeps
            # them past this point: peer.state is None, which `_copy` checks after its
            # last await, and the byte views are released (using one raises ValueError).
            for view in views:
                view.release()
            del caches, views
            for mapping in maps:
                with contextlib.suppress(BufferError):
                    mapping.close()
