"""`kvtransfer.host_probe`: only a process that is gone reads as gone."""

from __future__ import annotations

import ctypes
import subprocess
import sys

from kvtransfer.host_probe import HostProbe, identity


def test_a_process_reads_alive_until_it_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        # an address not mapped there: EFAULT says nothing about the process
        unknown = HostProbe(child.pid, 8)
        assert unknown.read() != 0 and unknown.alive()
    finally:
        child.kill()
        child.wait()
    assert not unknown.alive()  # ESRCH: gone


def test_a_probe_of_this_process_reads_its_byte() -> None:
    byte = ctypes.create_string_buffer(b"x", 1)
    mine = identity()
    probe = HostProbe.of(mine, ctypes.addressof(byte))
    assert probe is not None and probe.read() == 0 and probe.alive()
    assert HostProbe.of({**mine, "boot_id": "elsewhere"}, ctypes.addressof(byte)) is None
    assert HostProbe.of(mine, 8) is None  # unreadable: no probe (logged)
