"""Tensor-parallel KV caches that rank 0 can address: on CPU each rank allocates its
KV cache (its KV heads of every block) in a named POSIX shared-memory segment, and rank
0 maps every rank's, so the hand-off, the tiers and peer fetch move each rank's heads
between its own cache and the wire with no copy through rank 0's.

Names are fixed by the group, `splitserve-kv-<rank 0's pid>-tp<rendezvous port>r<rank>`,
so any rank can unlink all of them: rank 0 at close and when a rank fails, a rank when
rank 0 is gone. After a SIGKILL of the whole group they stay until
`kvtransfer.shm.reap_orphaned_segments` runs (the pid in them is rank 0's). CUDA caches
stay in device memory (no segment).
"""

from __future__ import annotations

import contextlib
import mmap
import os

import torch

SHM_DIR = "/dev/shm"  # where Linux's shm_open keeps POSIX segments


def reserve(fd: int, nbytes: int, name: str) -> None:
    """Sizes a new segment and takes its memory now: a tmpfs past its size limit (a
    container's /dev/shm) would otherwise fail on a later write, with SIGBUS."""
    os.ftruncate(fd, nbytes)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        raise OSError(e.errno, f"{SHM_DIR} has no room for the {nbytes:,}-byte KV segment "
                      f"{name} ({e.strerror}): enlarge it (docker --shm-size, a "
                      "memory-backed emptyDir) or use fewer KV blocks") from None


def segment_names(root_pid: int, port: int, size: int) -> list[str]:
    """Every rank's segment name, rank 0's first."""
    return [f"splitserve-kv-{root_pid}-tp{port}r{r}" for r in range(size)]


def unlink_segments(names: list[str]) -> None:
    """Removes the names (mappings stay valid until dropped); missing ones are fine."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))


class RankSegment:
    """One rank's KV cache in a named segment: created by its rank (zeroed), mapped by
    rank 0. `tensor` is backed by the mapping, which lives as long as this object."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 create: bool) -> None:
        self.name = name
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        path = os.path.join(SHM_DIR, name)
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR if create else os.O_RDWR
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                reserve(fd, nbytes, name)
            elif os.fstat(fd).st_size != nbytes:
                raise ValueError(f"segment {name} holds {os.fstat(fd).st_size} bytes, "
                                 f"expected {nbytes}")
            self._map = mmap.mmap(fd, nbytes)
        except BaseException:
            if create:
                unlink_segments([name])
            raise
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8).view(dtype).view(shape)
