"""bench.pin confines a program to the cores it names, one thread per core."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.pin import parse_cores


def test_parse_cores() -> None:
    assert parse_cores("0") == {0}
    n = os.cpu_count() or 1
    assert parse_cores(f"0-{n - 1}") == set(range(n))
    for bad in ("", str(n), "-1", "0,99"):
        with pytest.raises(ValueError):
            parse_cores(bad)


def test_pinned_program_sees_one_core() -> None:
    core = (os.cpu_count() or 1) - 1
    out = subprocess.run(
        [sys.executable, "-m", "bench.pin", str(core), "--", sys.executable, "-c",
         "import os; print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])"],
        capture_output=True, text=True, timeout=30, check=True).stdout
    assert out.split() == [f"[{core}]", "1"]
