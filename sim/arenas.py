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

The larger allocations (lists and dicts past 512 bytes: block tables, a route's numpy
arrays and per-worker dicts) bypass the arenas for malloc. A
request makes dozens, freed soon after; glibc's malloc serves them slower than TCMalloc
(Debian's libtcmalloc-minimal4, `make sysdeps`), which vLLM's and PyTorch's CPU guides
preload for the same reason. `splitserve sim` starts itself again with it preloaded
when the library is there (cluster/cli.py; SPLITSERVE_SIM_MALLOC=system keeps glibc's; a
library user's own process keeps its malloc unless it is started with LD_PRELOAD itself):
`sim bench --workers 512`, this 2-core box, one after the other: 200,000 requests at
16-token blocks 303.7 -> 262.9 s (13 %), 100,000 at 512-token blocks 97.3 -> 81.2 s
(17 %); alternated, 100,000 at 16: 146.3 / 152.3 -> 138.1 / 141.4 s. (glibc's tunables
for its trim and mmap thresholds: nothing. jemalloc and mimalloc: between the two.)
"""

from __future__ import annotations

import ctypes.util
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


MALLOC = "tcmalloc_minimal"  # the library `splitserve sim` preloads (libtcmalloc_minimal.so.4)


def malloc_library() -> str | None:
    """The TCMalloc library to preload (its soname), or None when this machine has none."""
    return ctypes.util.find_library(MALLOC)


def malloc_in_use() -> str:
    """The malloc serving this process: "tcmalloc" when it is loaded, else "system malloc"."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "system malloc"
    return "tcmalloc" if f"lib{MALLOC}" in maps else "system malloc"


def heap() -> str:
    """What this process's objects live on, for reports: the arenas, then the malloc
    (and, where the machine has no TCMalloc to run on, how to get it)."""
    malloc = malloc_in_use()
    if malloc == "system malloc" and malloc_library() is None:
        malloc += f" (no lib{MALLOC}.so.4 here: `make sysdeps` installs it)"
    return f"{status()}, {malloc}"
