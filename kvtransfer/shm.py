"""`shm`: same host; the receiver's KV cache lives in a POSIX shared-memory segment
that the sender maps and writes directly (one copy, no socket in the data path).

Fencing needs one round trip per `write()` call, because the bytes land before the
receiver can look at them:

    sender -> RESERVE {req, xfer, gen, regions}     receiver admits (fence check)
    sender <- GRANT {req, ok, expires}              cells claimed, in flight
    sender:   copies each region while now < expires (CLOCK_MONOTONIC is
              system-wide on Linux, so both processes read the same clock)
    sender -> WRITE (in place, checksum) per region receiver verifies, marks landed

A transfer failed while grants are out resolves once they land or expire, so a
failed transfer's blocks are never written after its failure is reported (for a
sender that honours `expires`: peers are authenticated members of the cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer import wire
from kvtransfer.errors import ProtocolError, TransferTimeout, error_from_kind
from kvtransfer.layout import KVLayout, Region
from kvtransfer.memory import checksum as compute_checksum
from kvtransfer.memory import torch_dtype
from kvtransfer.receiver import Conn, ReceiverBase
from kvtransfer.sender import Peer, SenderBase
from kvtransfer.wire import Frame

SHM_DIR = "/dev/shm"  # where Linux's shm_open keeps POSIX segments
_GRANT_MARGIN_S = 0.5  # receiver waits this long past `expires` before reusing cells


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
            os.ftruncate(fd, self.nbytes)
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
    cannot unlink its own). Names carry the creator's pid; call at service start."""
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


@dataclass(slots=True)
class _Grant:
    xfer_id: str
    generation: int
    pending: set[Region]
    timer: asyncio.TimerHandle | None = None


@dataclass(slots=True)
class _ConnGrants:
    by_region: dict[tuple[str, int, Region], int] = field(default_factory=dict)
    grants: dict[int, _Grant] = field(default_factory=dict)


class ShmReceiver(ReceiverBase):
    name = "shm"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shared: SharedKV | None = None
        self._grants: dict[int, _ConnGrants] = {}

    def allocate(self, layout: KVLayout, num_blocks: int) -> torch.Tensor:
        """Create the shared KV cache and register it; returns the engine's KV tensor."""
        kv, shared = allocate_shared_kv(layout, num_blocks, self.config.shm_name)
        self.register_shared(shared, layout)
        return kv

    def register_shared(self, shared: SharedKV, layout: KVLayout) -> None:
        self.shared = shared
        super().register(shared.tensor, layout)

    def register(self, kv: Any, layout: KVLayout) -> None:
        if self.shared is None or kv is not self.shared.tensor:
            raise ValueError("shm needs its KV cache in shared memory: use allocate() or "
                             "register_shared(allocate_shared_kv(...))")
        super().register(kv, layout)

    def _welcome_extra(self, conn: Conn) -> dict[str, Any]:
        assert self.shared is not None
        return {"shm_name": self.shared.name, "shm_bytes": self.shared.nbytes}

    async def _on_reserve(self, conn: Conn, msg: dict[str, Any]) -> None:
        xfer_id, gen = str(msg["xfer"]), int(msg["gen"])
        regions = [Region(*r) for r in msg["regions"]]
        admitted: list[Region] = []
        for region in regions:
            if not self.table.admit(xfer_id, gen, region, conn.id):
                break
            admitted.append(region)
        if len(admitted) < len(regions):
            error = self.table.error_of(xfer_id) or self._results.get((xfer_id, gen))
            kind = error.kind if error is not None else "cancelled"
            for _ in admitted:
                self.table.released(xfer_id, ProtocolError("reservation refused"))
            await self._send(conn, wire.pack_json(Frame.GRANT, {
                "req": msg["req"], "ok": False, "kind": kind,
                "message": f"{xfer_id} gen {gen} is fenced or not expected"}))
            return
        loop = asyncio.get_running_loop()
        grant_s = self.config.io_timeout_s
        book = self._grants.setdefault(conn.id, _ConnGrants())
        grant = _Grant(xfer_id, gen, set(regions))
        grant.timer = loop.call_later(grant_s + _GRANT_MARGIN_S, self._expire, conn.id,
                                      int(msg["req"]))
        book.grants[int(msg["req"])] = grant
        book.by_region.update({(xfer_id, gen, r): int(msg["req"]) for r in regions})
        await self._send(conn, wire.pack_json(Frame.GRANT, {
            "req": msg["req"], "ok": True, "expires": time.monotonic() + grant_s}))

    async def _on_write(self, conn: Conn, header: wire.WriteHeader, payload_len: int) -> None:
        book = self._grants.get(conn.id)
        key = (header.xfer_id, header.generation, header.region)
        req = None if book is None else book.by_region.pop(key, None)
        if book is None or req is None or payload_len or not header.flags & wire.FLAG_IN_PLACE:
            raise ProtocolError(f"shm write of {header.region} without a grant")
        grant = book.grants[req]
        grant.pending.discard(header.region)
        if not grant.pending:
            self._close_grant(book, req)
        ok = True
        if header.flags & wire.FLAG_CHECKSUM and self.table.is_live(header.xfer_id,
                                                                   header.generation):
            assert self.kv is not None
            ok = compute_checksum(self.kv.view(header.region)) == header.checksum
        self.table.landed(header.xfer_id, header.region, ok)

    def _expire(self, conn_id: int, req: int) -> None:
        book = self._grants.get(conn_id)
        if book is None or req not in book.grants:
            return
        grant = book.grants[req]
        for region in grant.pending:
            book.by_region.pop((grant.xfer_id, grant.generation, region), None)
            self.table.released(grant.xfer_id, TransferTimeout(
                f"{grant.xfer_id}: shm write grant expired"))
        self._close_grant(book, req)

    def _close_grant(self, book: _ConnGrants, req: int) -> None:
        grant = book.grants.pop(req)
        if grant.timer is not None:
            grant.timer.cancel()

    def _on_conn_closed(self, conn: Conn) -> None:
        # Outstanding grants stay until they expire: a sender that lost its
        # connection may still be inside a copy; `expires` bounds that.
        book = self._grants.get(conn.id)
        if book is not None and not book.grants:
            del self._grants[conn.id]

    def _close_memory(self) -> None:
        for book in self._grants.values():
            for grant in book.grants.values():
                if grant.timer is not None:
                    grant.timer.cancel()
        self._grants.clear()
        if self.shared is not None:
            self.shared.close()


class ShmSender(SenderBase):
    name = "shm"

    async def _on_connected(self, peer: Peer) -> None:
        path = os.path.join(SHM_DIR, str(peer.welcome["shm_name"]))
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, int(peer.welcome["shm_bytes"]))
        finally:
            os.close(fd)
        peer.state = (mapping, torch.frombuffer(mapping, dtype=torch.uint8))

    async def _send_regions(self, peer: Peer, pairs: list[tuple[Region, Region]],
                            xfer_id: str, generation: int, checksum: bool) -> None:
        assert self.kv is not None
        loop = asyncio.get_running_loop()
        req = secrets.randbits(62)
        reply_future: asyncio.Future[dict[str, Any]] = loop.create_future()
        peer.replies[req] = reply_future
        regions = [[d.block_id, d.layer_start, d.layer_end, d.num_blocks] for _, d in pairs]
        await self._send_frame(peer, wire.pack_json(Frame.RESERVE, {
            "req": req, "xfer": xfer_id, "gen": generation, "regions": regions}))
        grant = await reply_future
        if not grant["ok"]:
            raise error_from_kind(grant["kind"], grant["message"])
        dst_bytes: torch.Tensor = peer.state[1]
        frames = []
        for src, dst in pairs:
            if time.monotonic() >= grant["expires"]:
                raise TransferTimeout(f"{xfer_id}: shm grant expired before the copy")
            off, n = dst.resolve(self.kv.layout, len(dst_bytes) // self.kv.layout.block_bytes)
            src_bytes = self.kv.device_slice(src)
            dst_bytes[off:off + n].copy_(src_bytes)
            csum = compute_checksum(self.kv.view(src)) if checksum and not self.kv.is_cuda \
                else (self.kv.checksum(src) if checksum else 0)
            flags = wire.FLAG_IN_PLACE | (wire.FLAG_CHECKSUM if checksum else 0)
            meta = wire.WriteHeader(xfer_id, generation, dst, flags, csum).pack()
            frames.append(wire.pack_frame(Frame.WRITE, meta))
        await self._send_frame(peer, b"".join(frames))

    async def _on_disconnected(self, peer: Peer) -> None:
        if peer.state is not None:
            mapping, view = peer.state
            peer.state = None
            del view
            with contextlib.suppress(BufferError):
                mapping.close()
