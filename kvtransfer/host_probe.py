"""Whether a receiver on this node still has its memory: one byte read from its cache
with `process_vm_readv`, a syscall's cost.

With UCX's endpoint error handling off (its fast `cma` path, `kvtransfer/ucx.py`), a put
into a process that died makes UCX abort the sender. An in-place sender holds its grant
for the whole transfer and sends no request per chunk, so before each chunk's puts it
probes the receiver it shares a node (and a PID namespace) with; the window left is the
probe-to-put microseconds. Receivers on other nodes are not probed.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any


def identity() -> dict[str, Any]:
    """What a receiver tells senders so that one on its node can probe it."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return {"boot_id": boot, "pid": os.getpid(), "pidns": os.stat("/proc/self/ns/pid").st_ino}


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class HostProbe:
    def __init__(self, pid: int, address: int) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._readv = libc.process_vm_readv
        self._readv.restype = ctypes.c_ssize_t
        self._pid = pid
        self._byte = ctypes.create_string_buffer(1)
        self._local = _IoVec(ctypes.cast(self._byte, ctypes.c_void_p), 1)
        self._remote = _IoVec(address, 1)

    @classmethod
    def of(cls, theirs: Any, address: int) -> HostProbe | None:
        """A probe of the receiver that sent `theirs` (its `identity()`), or None when
        it is on another node or in another PID namespace, or cannot be read."""
        mine = identity()
        if not isinstance(theirs, dict) or any(theirs.get(k) != mine[k]
                                                for k in ("boot_id", "pidns")):
            return None
        probe = cls(int(theirs["pid"]), address)
        return probe if probe.alive() else None

    def alive(self) -> bool:
        done = self._readv(self._pid, ctypes.byref(self._local), 1,
                           ctypes.byref(self._remote), 1, 0)
        return bool(done == 1)

