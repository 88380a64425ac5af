"""Whether a receiver on this node still has its memory: one byte read from its cache
with `process_vm_readv`, a syscall's cost.

With UCX's endpoint error handling off (its fast `cma` path, `kvtransfer/ucx.py`), a put
into a process that died makes UCX abort the sender. An in-place sender holds its grant
for the whole transfer and sends no request per chunk, so before each chunk's puts it
probes the receiver it shares a node (and a PID namespace) with: one probe per chunk,
covering every lane batch of that chunk's puts (a receiver dying during them is not
seen). Only ESRCH (no such process) means gone; another failure (EPERM under a ptrace
policy, EFAULT) says nothing, so the receiver counts as alive and the sender logs at
connect that probing is unavailable and why. Receivers on other nodes are not probed.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from typing import Any

log = logging.getLogger(__name__)


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
        if (err := probe.read()) != 0:
            log.warning("cannot probe the receiver (pid %s) on this node: %s; a put into "
                        "it after it died aborts this process", theirs["pid"],
                        os.strerror(err))
            return None
        return probe

    def read(self) -> int:
        """Reads the byte: 0, or the errno of the failure."""
        done = self._readv(self._pid, ctypes.byref(self._local), 1,
                           ctypes.byref(self._remote), 1, 0)
        return 0 if done == 1 else ctypes.get_errno() or errno.EIO

    def alive(self) -> bool:
        """False only when the process is gone (ESRCH); unknown counts as alive."""
        return self.read() != errno.ESRCH

