"""The channel between the simulator's two processes (sim/split.py): batches of
pickled messages each way through shared memory, a ring per direction.

Over pipes, each batch's write and each wake of the other process cost a system call
and, on a virtual machine, an interrupt across cores, on both sides: ~6 % of each
process's time at 512 workers, and the waits behind them. Through shared memory a
batch is a copy and a word stored; a waiting reader polls the word first (the other
process answers within microseconds most of the time), then sleeps on an eventfd that
the writer signals only when the reader says it sleeps. 30,000 requests of the Mooncake
trace on 512 workers, alternated: 19.2 / 18.9 s over pipes, 16.4 / 15.0 s here.
"""

from __future__ import annotations

import mmap
import os
import pickle
import platform
import select
import struct
import time
import weakref
from typing import Any

_HEADER = struct.Struct("<Q")
# Messages sent at once at most: the gateway applies a batch while the workers go on
# (over pipes 4: 25.3 s, 12: 24.8 s, only at arrivals: 25.8 s for 30,000 requests on 512
# workers; through shared memory 3 and 12 the same within the box's noise)
_BATCH = 12

# A ring's shared memory: its write position (the writer's), a flag the reader raises
# while it sleeps, its read position (the reader's; a cache line apart), then the bytes.
# Positions count bytes ever written / read; each is stored and loaded as one aligned
# 8-byte word through a memoryview of words (struct's pack_into would zero the word
# before it writes it: a reader could see 0).
_W, _R = 0, 8  # words
_ASLEEP, _DATA = 16, 128  # bytes
_RING = 8 << 20  # bytes; a batch larger than the ring goes through in parts
_SPIN_S = 0.002  # a reader polls this long for bytes before it sleeps on the wake fd
_NAP_S = 0.001  # a sleeper looks again this often (a wake lost to a race costs this)


class Ring:
    """One direction of a Channel: a byte stream through shared memory (anonymous,
    MAP_SHARED: a fork shares it) and an eventfd that wakes a sleeping reader. The
    writer copies the bytes in, then publishes its position; the reader sees the
    position, then reads the bytes: x86's stores reach other cores in program order
    (TSO), so bytes behind a published position are there (`check_platform`)."""

    def __init__(self, size: int = _RING) -> None:
        self.size = size
        self.mem = mmap.mmap(-1, _DATA + size)
        self.wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


def check_platform() -> None:
    """Refuses a CPU on which the rings' publication order is not guaranteed."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError("the gateway's own process (--gateway-process) needs an x86-64 "
                           f"CPU (its shared-memory channel relies on TSO), not "
                           f"{platform.machine()}")


class Channel:
    """Batches of messages each way through shared memory (Ring): `send` queues,
    `flush` writes the queue as one pickle, `recv` returns the next message (waiting
    for a batch). A waiting reader polls first (the other process answers within
    microseconds most of the time, and a wake across cores costs a VM exit on this
    box), then sleeps on the ring's eventfd. `life`: a pipe only the other process
    writes to, never written: it reads EOF once that process is gone."""

    def __init__(self, rx: Ring, tx: Ring, life_fd: int, life_out: int) -> None:
        self._rx, self._tx = rx.mem, tx.mem
        self._rx_size, self._tx_size = rx.size, tx.size
        self._rx_pos = memoryview(rx.mem)[:_DATA].cast("Q")
        self._tx_pos = memoryview(tx.mem)[:_DATA].cast("Q")
        self._rx_wake, self._tx_wake = rx.wake, tx.wake
        self._life = life_fd
        # closed when the channel goes, however the run ended: the other side sees EOF
        self._closer = weakref.finalize(self, _close, life_out, life_fd, rx.wake, tx.wake)
        self._r = 0  # bytes read from rx
        self._w = 0  # bytes written to tx
        self.waited = 0.0  # seconds `recv` waited for the other process
        self._queue: list[Any] = []
        self._batch: list[Any] = []
        self._next = 0

    def send(self, msg: Any) -> None:
        self._queue.append(msg)
        if len(self._queue) >= _BATCH:
            self.flush()

    def flush(self) -> None:
        if not self._queue:
            return
        data = pickle.dumps(self._queue, pickle.HIGHEST_PROTOCOL)
        self._queue = []
        self._write(_HEADER.pack(len(data)) + data)

    def recv(self) -> Any:
        if self._next == len(self._batch):
            (n,) = _HEADER.unpack(self._read(_HEADER.size))
            self._batch = pickle.loads(self._read(n))
            self._next = 0
        msg = self._batch[self._next]
        self._next += 1
        return msg

    def close(self) -> None:
        self._closer()

    def _write(self, data: bytes) -> None:
        mem, pos, w, size = self._tx, self._tx_pos, self._w, self._tx_size
        view = memoryview(data)
        while view:
            free = size - (w - pos[_R])
            if not free:  # the reader is a ring behind: rare, and never for long
                self._nap()
                continue
            at = w % size
            k = min(len(view), free, size - at)
            mem[_DATA + at:_DATA + at + k] = view[:k]
            view = view[k:]
            w += k
            pos[_W] = w  # published: after its bytes
            if mem[_ASLEEP]:
                os.eventfd_write(self._tx_wake, 1)
        self._w = w

    def _read(self, n: int) -> bytes:
        mem, pos, r, size = self._rx, self._rx_pos, self._r, self._rx_size
        parts = []
        while n:
            w = pos[_W]
            if w == r:
                w = self._wait(r)
            at = r % size
            k = min(n, w - r, size - at)
            parts.append(mem[_DATA + at:_DATA + at + k])
            r += k
            n -= k
            pos[_R] = r
        self._r = r
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _wait(self, r: int) -> int:
        """The write position once it passes `r`: polled, then slept for."""
        mem, pos = self._rx, self._rx_pos
        start = time.perf_counter()
        end = start + _SPIN_S
        while (now := time.perf_counter()) < end:
            if (w := pos[_W]) != r:
                self.waited += now - start
                return w
        while True:
            mem[_ASLEEP] = 1
            if (w := pos[_W]) != r:
                mem[_ASLEEP] = 0
                self.waited += time.perf_counter() - start
                return w
            self._nap(self._rx_wake)

    def _nap(self, wake: int = -1) -> None:
        """Sleeps until `wake` fires or a nap passes; EOFError when the other process
        has gone."""
        fds = [self._life] if wake < 0 else [self._life, wake]
        ready, _, _ = select.select(fds, [], [], _NAP_S)
        if self._life in ready:
            raise EOFError("the other process of the simulation has gone")
        if wake in ready:
            try:
                os.eventfd_read(wake)
            except BlockingIOError:
                pass


def fork_channel(size: int = _RING) -> tuple[Channel, int]:
    """Forks; returns this process's end of a Channel to the other one, and fork's
    result (0 in the child)."""
    check_platform()
    down, up = Ring(size), Ring(size)  # to the child, to the parent
    # each process's life: a pipe it holds the write end of (never written)
    parent_r, parent_w = os.pipe()
    child_r, child_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(parent_w)
        os.close(child_r)
        return Channel(down, up, parent_r, child_w), 0
    os.close(parent_r)
    os.close(child_w)
    return Channel(up, down, child_r, parent_w), pid
