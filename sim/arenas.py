"""Huge-page arenas for the simulator's process (sim/_arenas.c, compiled by `make`).

A simulation of 512 workers at the engine's 16-token blocks holds ~3.7 GB of small
Python objects (the pools' blocks, their hash ints, the requests' state), touched in no
order the CPU's caches or TLB can follow: every step of every worker lands on memory
no other step touched lately. In 4 KiB pages each of those touches also walks the page
tables. Served from one region in 2 MiB pages (and never handed back to the kernel,
so never faulted in again), the same run goes ~10-13 % faster at 16-token blocks on
this box (`sim bench --workers 512`, 60,000 requests, side by side); at 512-token blocks
(0.5 GB) it changes nothing measurable. glibc's own huge pages for the larger
allocations (GLIBC_TUNABLES=glibc.malloc.hugetlb=1) made it slower: not used.

It changes where objects live, nothing the simulation computes: tests/unit/sim/
test_arenas.py holds a run with it to the same results as one without. `splitserve sim`
installs it before anything is built (cluster/cli.py); a library user may call
`install()` first thing, or not at all.
"""

from __future__ import annotations

import importlib

REGION_BYTES = 64 << 30  # address space reserved (not memory used): 64 GiB

_status: str | None = None


def install(region_bytes: int = REGION_BYTES) -> str:
    """Serves CPython's object arenas from a huge-page region from now on (once per
    process); returns what this process runs with, for reports."""
    global _status
    if _status is None:
        try:
            arenas = importlib.import_module("sim._arenas")
        except ImportError:
            _status = "4 KiB pages (sim/_arenas.c not built: `make deps`)"
        else:
            try:
                advised = arenas.install(region_bytes)
            except OSError as e:
                _status = f"4 KiB pages (no region: {e})"
            else:
                _status = "huge-page arenas" if advised else \
                    "reused arenas, 4 KiB pages (the kernel refused huge pages)"
    return _status


def status() -> str:
    """What this process's object arenas are (`install`'s answer, if it ran)."""
    return _status or "4 KiB pages (not installed)"


def stats() -> tuple[int, int, int] | None:
    """(arenas handed out new, arenas reused, requests passed on), or None when not
    installed."""
    if _status is None or not _status.startswith(("huge", "reused")):
        return None
    return tuple(importlib.import_module("sim._arenas").stats())  # type: ignore[return-value]
