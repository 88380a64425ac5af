"""Local disk tier: one file per block, `<hash hex>.kvb`, LRU by in-memory order
(persisted through file mtimes, so the order survives a restart).

File: a 4 KiB header (magic, layout fingerprint, block hash, payload size, xxh3-64 of
the payload) then the block's bytes, padded to 4 KiB. Files are written as
`<name>.tmp` and renamed into place, so a crash leaves either a whole file or a .tmp
orphan; `start` deletes orphans and files whose header or size is wrong, and rebuilds
the index from the rest. `get` verifies the checksum; a corrupt file is a miss (and is
deleted).

I/O uses O_DIRECT (page cache bypass, aligned bounce buffer) where the filesystem
accepts it (ext4, xfs: yes; tmpfs: no) and plain buffered I/O otherwise; `direct_io`
says which. The directory is locked (flock) so two workers never share it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import struct
from collections.abc import Sequence

import torch
import xxhash

from engine.block_hash import HASH_SIZE, BlockHash
from kvtransfer.layout import KVLayout
from kvtransfer.memory import host_bytes, torch_dtype
from kvtransfer.tiers.base import SpareFn, TierError
from kvtransfer.tiers.lru import LRUSlots

log = logging.getLogger(__name__)

ALIGN = 4096
MAGIC = b"SSKVBLK1"
SUFFIX = ".kvb"
# the float8 KV scales the directory's blocks were written under (disk_scales.py)
SCALES_FILE = "kv_scales.json"
_HEADER = struct.Struct(f"<8s16s{HASH_SIZE}sQQ")  # magic, layout fp, hash, nbytes, xxh3


def layout_fingerprint(layout: KVLayout) -> bytes:
    return hashlib.blake2b(layout.to_json().encode(), digest_size=16).digest()


def _aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    off = -raw.data_ptr() % ALIGN
    return raw[off:off + nbytes]


def probe_direct_io(directory: str) -> bool:
    """Whether files in `directory` can be written and read with O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, ".direct-probe.tmp")
    buf = _aligned(ALIGN)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.pwrite(fd, host_bytes(buf), 0)
        finally:
            os.close(fd)
        return True
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        return False
    finally:
        if os.path.exists(path):
            os.unlink(path)


class DiskTier:
    name = "disk"

    def __init__(self, layout: KVLayout, directory: str, capacity: int,
                 direct_io: bool | None = None, spare_scan: int = 64) -> None:
        self.layout = layout
        self.directory = directory
        self.capacity = capacity
        self._lru = LRUSlots(capacity, spare_scan)
        self._fp = layout_fingerprint(layout)
        self._payload = layout.block_bytes
        self._file_bytes = ALIGN + -(-self._payload // ALIGN) * ALIGN
        os.makedirs(directory, exist_ok=True)
        self._lock_fd = os.open(os.path.join(directory, ".lock"), os.O_CREAT | os.O_RDWR,
                                0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._lock_fd)
            raise TierError(f"disk cache dir {directory!r} is in use by another worker") \
                from e
        supported = probe_direct_io(directory)
        if direct_io and not supported:
            raise TierError(f"O_DIRECT is not supported in {directory!r}")
        self.direct_io = supported if direct_io is None else direct_io
        self._buf = _aligned(self._file_bytes)  # bounce buffer (one block at a time)
        self.num_orphans_removed = self._recover()

    # -- start-up ----------------------------------------------------------------------
    def _recover(self) -> int:
        """Deletes orphans and bad files, indexes the good ones (oldest mtime first)."""
        removed = 0
        found: list[tuple[float, BlockHash]] = []
        for entry in os.scandir(self.directory):
            if entry.name in (".lock", SCALES_FILE) or not entry.is_file():
                continue
            h = self._valid_file(entry)
            if h is None:
                os.unlink(entry.path)
                removed += 1
            else:
                found.append((entry.stat().st_mtime, h))
        found.sort()
        for _, h in found[max(0, len(found) - self.capacity):]:
            self._lru.insert(h)
        for _, h in found[:max(0, len(found) - self.capacity)]:
            os.unlink(self._path(h))
            removed += 1
        if removed:
            log.info("disk tier %s: removed %d orphaned or invalid files", self.directory,
                     removed)
        return removed

    def _valid_file(self, entry: os.DirEntry[str]) -> BlockHash | None:
        if not entry.name.endswith(SUFFIX) or entry.stat().st_size != self._file_bytes:
            return None
        try:
            h = bytes.fromhex(entry.name[:-len(SUFFIX)])
        except ValueError:
            return None
        with open(entry.path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) != _HEADER.size:
            return None
        magic, fp, fh, nbytes, _ = _HEADER.unpack(head)
        ok = magic == MAGIC and fp == self._fp and fh == h and nbytes == self._payload
        return h if ok else None

    # -- the tier ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._lru)

    def _path(self, h: BlockHash) -> str:
        return os.path.join(self.directory, h.hex() + SUFFIX)

    def contains(self, hashes: Sequence[BlockHash]) -> int:
        return self._lru.leading(hashes)

    def get(self, hashes: Sequence[BlockHash], dst: Sequence[torch.Tensor]) -> int:
        n = 0
        for h, d in zip(hashes[:self._lru.leading(hashes)], dst, strict=False):
            if not self._read(h, d):
                break
            self._lru.touch(h)
            os.utime(self._path(h))
            n += 1
        return n

    def put(self, hashes: Sequence[BlockHash], src: Sequence[torch.Tensor],
            spare: SpareFn | None = None) -> list[BlockHash]:
        evicted: list[BlockHash] = []
        for h, s in zip(hashes, src, strict=True):
            if h in self._lru:
                self._lru.touch(h)
                continue
            if not self._lru.num_free:
                victim = self._lru.victims(1, spare)[0]
                self._drop(victim)
                evicted.append(victim)
            self._write(h, s)
            self._lru.insert(h)
        return evicted

    def victims(self, n: int, spare: SpareFn | None = None) -> list[BlockHash]:
        return self._lru.victims(n, spare)

    def evict(self, hashes: Sequence[BlockHash]) -> int:
        return sum(self._drop(h) for h in hashes)

    def hashes(self) -> list[BlockHash]:
        return list(self._lru)

    def check_integrity(self) -> None:
        self._lru.check_integrity()
        names = {e.name for e in os.scandir(self.directory) if e.name.endswith(SUFFIX)}
        assert names == {h.hex() + SUFFIX for h in self._lru}, "index != files on disk"

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    # -- I/O ---------------------------------------------------------------------------
    def _drop(self, h: BlockHash) -> bool:
        if self._lru.remove(h) is None:
            return False
        try:
            os.unlink(self._path(h))
        except FileNotFoundError:
            pass
        return True

    def _flags(self) -> int:
        return os.O_DIRECT if self.direct_io else 0

    def _write(self, h: BlockHash, src: torch.Tensor) -> None:
        payload = self._buf[ALIGN:ALIGN + self._payload]
        payload.view(torch_dtype(self.layout)).view(src.shape).copy_(src)
        data = host_bytes(payload)
        head = _HEADER.pack(MAGIC, self._fp, h, self._payload, xxhash.xxh3_64_intdigest(data))
        self._buf[:ALIGN].zero_()
        self._buf[:len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        tmp = self._path(h) + ".tmp"
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | self._flags(), 0o600)
            try:
                if os.pwrite(fd, host_bytes(self._buf), 0) != self._file_bytes:
                    raise OSError(errno.EIO, "short write")
            finally:
                os.close(fd)
            os.rename(tmp, self._path(h))
        except OSError as e:
            _unlink_quiet(tmp)
            raise TierError(f"disk tier write of {h.hex()} failed: {e}") from e

    def _read(self, h: BlockHash, dst: torch.Tensor) -> bool:
        try:
            fd = os.open(self._path(h), os.O_RDONLY | self._flags())
            try:
                got = os.preadv(fd, [host_bytes(self._buf)], 0)
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("disk tier read of %s failed: %s", h.hex(), e)
            self._drop(h)
            return False
        payload = self._buf[ALIGN:ALIGN + self._payload]
        magic, fp, fh, nbytes, digest = _HEADER.unpack(self._buf[:_HEADER.size].numpy().tobytes())
        if got != self._file_bytes or (magic, fp, fh, nbytes) != \
                (MAGIC, self._fp, h, self._payload) or \
                xxhash.xxh3_64_intdigest(host_bytes(payload)) != digest:
            log.warning("disk tier: %s is corrupt; dropped", h.hex())
            self._drop(h)
            return False
        dst.copy_(payload.view(torch_dtype(self.layout)).view(dst.shape))
        return True


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
