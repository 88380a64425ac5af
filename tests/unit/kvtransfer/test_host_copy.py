"""`kvtransfer.host_copy`: writes into another process on this node, and a receiver that
is gone (or whose memory is) is a PeerUnavailable, never a crash."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time

import numpy as np
import pytest

from kvtransfer.errors import PeerUnavailable, TransferTimeout
from kvtransfer.host_copy import HostCopy, cut, identity


def test_cut_keeps_every_byte_in_order() -> None:
    rows = np.array([[1000, 10, 5000], [0, 0, 0], [2000, 3, 9000]], dtype=np.int64)
    out = cut(rows, 4)
    assert out.tolist() == [[1000, 4, 5000], [1004, 4, 5004], [1008, 2, 5008],
                            [2000, 3, 9000]]
    assert cut(rows[2:], 4).tolist() == [[2000, 3, 9000]]


def test_a_write_lands_across_calls_and_stops_at_its_bound() -> None:
    # this process as its own receiver: many iovecs and runs longer than one call
    src = np.arange(3 << 20, dtype=np.uint8)
    dst = np.zeros(12 << 20, dtype=np.uint8)
    host = HostCopy.of(identity(), dst.ctypes.data)
    assert host is not None
    runs = 3000  # more than one call's 1024 iovecs
    size = 512
    parts = [(src.ctypes.data + i * size, size, dst.ctypes.data + 2 * i * size)
             for i in range(runs)]
    parts.append((src.ctypes.data, len(src), dst.ctypes.data + (8 << 20)))  # > one call
    host.write(np.array(parts, dtype=np.int64))
    for i in (0, 1, runs - 1):
        assert (dst[2 * i * size:2 * i * size + size] == src[i * size:i * size + size]).all()
        assert not dst[2 * i * size + size:2 * i * size + 2 * size].any()
    assert (dst[8 << 20:(8 << 20) + len(src)] == src).all()
    with pytest.raises(TransferTimeout):
        host.write(np.array(parts, dtype=np.int64), bound=time.monotonic() - 1)
    host.stop()
    with pytest.raises(PeerUnavailable):
        host.write(np.array(parts, dtype=np.int64))


def test_a_receiver_gone_is_peer_unavailable() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    buf = ctypes.create_string_buffer(b"x", 64)
    host = HostCopy(child.pid)
    try:
        with pytest.raises(PeerUnavailable, match="memory"):  # EFAULT: not mapped there
            host.write(np.array([(ctypes.addressof(buf), 64, 8)], dtype=np.int64))
    finally:
        child.kill()
        child.wait()
    with pytest.raises(PeerUnavailable, match="process is gone"):  # ESRCH
        host.write(np.array([(ctypes.addressof(buf), 64, 1 << 20)], dtype=np.int64))


def test_only_a_readable_receiver_on_this_node_is_written_directly() -> None:
    byte = ctypes.create_string_buffer(b"x", 1)
    mine = identity()
    host = HostCopy.of(mine, ctypes.addressof(byte))
    assert host is not None and host.read_byte(ctypes.addressof(byte)) == 0
    assert HostCopy.of({**mine, "boot_id": "elsewhere"}, ctypes.addressof(byte)) is None
    assert HostCopy.of(None, ctypes.addressof(byte)) is None  # a GPU receiver says no node
    assert HostCopy.of(mine, 8) is None  # unreadable: UCX moves its bytes (logged)


def test_lanes_write_side_by_side_and_report_a_failure_after_all_ended() -> None:
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    src = np.arange(1 << 20, dtype=np.uint8)
    dst = np.zeros(2 << 20, dtype=np.uint8)
    host = HostCopy.of(identity(), dst.ctypes.data)
    assert host is not None
    half = len(src) // 2
    plan = [np.array([(src.ctypes.data, half, dst.ctypes.data)], dtype=np.int64),
            np.array([(src.ctypes.data + half, half, dst.ctypes.data + half)], dtype=np.int64),
            np.zeros((0, 3), dtype=np.int64)]  # a lane with nothing to copy
    issuing: set[object] = set()

    async def main() -> None:
        with ThreadPoolExecutor(2) as pool:
            await host.write_lanes(pool, plan, None, issuing)
            assert (dst[:len(src)] == src).all() and not issuing
            await host.write_lanes(pool, [plan[2]], None, issuing)  # nothing at all
            bad = [plan[0], np.array([(src.ctypes.data, 64, 8)], dtype=np.int64)]
            with pytest.raises(PeerUnavailable):  # the other lane ended first
                await host.write_lanes(pool, bad, None, issuing)
            assert not issuing

    asyncio.run(main())
