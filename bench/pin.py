"""`python -m bench.pin CORES -- PROGRAM ARGS...`: run PROGRAM pinned to CPU cores.

Sets the CPU affinity and one thread per pinned core for OpenMP/torch before exec, so
a worker started through it never spreads onto cores another worker was given (the
experiments compare colocated and disaggregated workers core for core). Linux only.
"""

from __future__ import annotations

import os
import sys


def parse_cores(text: str) -> set[int]:
    """"0", "0,1" or "0-3" -> a set of core ids, each < os.cpu_count()."""
    cores: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    n = os.cpu_count() or 1
    if not cores or any(not 0 <= c < n for c in cores):
        raise ValueError(f"cores {text!r} must name cores in [0, {n})")
    return cores


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m bench.pin CORES -- PROGRAM [ARGS...]", file=sys.stderr)
        return 2
    try:
        cores = parse_cores(argv[0])
    except ValueError as e:
        print(f"bench.pin: {e}", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, cores)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(len(cores))
    os.execvp(argv[2], argv[2:])
    return 127  # not reached: exec replaces this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
