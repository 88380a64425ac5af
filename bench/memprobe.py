"""The machine's memory latency, as a reference measured in the same run as a figure
that waits on it: nanoseconds per dependent load (a random cycle through a region: each
load's address is the last load's value, so none overlaps another and no prefetcher
guesses the next) from two regions: one a quarter of the last-level cache the machine
reports (its L3: served from there when the cache is the process's own) and one far
larger than any cache (served from memory).

What it is for: `splitserve sim bench` at the engine's 16-token blocks spends most of a
late run waiting on such loads (millions of per-block objects touched in no order a
cache follows), and this shared box's caches and memory are shared with its neighbours:
the same code ran ~1.9x slower on one day than on another while the interpreter's own
speed did not move, and on that day a load from 8 MiB (inside its 32 MiB L3) took
64-119 ns, about what one from memory should. A sim bench figure reads against the
latencies measured with it.

Measured from Python (no C compiler needed): the steps over a cycle that fits the L1
cache time the interpreter's own cost of a step; the same steps over a region minus that
are its loads' latency. A region is a numpy array, which numpy backs with huge pages
where the kernel allows (as the simulator's arenas are), so the figures are the caches'
and memory's latency, not page-table walks'. `splitserve bench memory` prints them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

REGION_MIB = 256  # 8x this box's 32 MiB L3
SMALL = 1 << 10  # 8 KiB of int64: in L1
STEPS = 1_000_000  # ~0.2 s a pass here
L3_SYSFS = "/sys/devices/system/cpu/cpu0/cache/index3/size"


def l3_mib(path: str = L3_SYSFS) -> int:
    """The last-level cache the machine reports (MiB; 32 where it says nothing)."""
    try:
        with open(path) as f:
            text = f.read().strip().upper()
    except OSError:
        return 32
    scale = {"K": 1 / 1024, "M": 1, "G": 1024}.get(text[-1:], None)
    try:
        n = float(text[:-1]) * scale if scale is not None else float(text) / (1 << 20)
    except ValueError:
        return 32
    return max(1, round(n))


def _cycle(n: int, seed: int) -> memoryview:
    """A random cycle through n slots: slot i holds the next slot's index."""
    perm = np.random.default_rng(seed).permutation(n)
    nxt = np.empty(n, np.int64)
    nxt[perm] = np.roll(perm, -1)
    return nxt.data  # its buffer: indexing it gives Python ints at C speed


def _chase(cycle: memoryview, steps: int) -> float:
    """Seconds per step of following `cycle` from slot 0."""
    p = 0
    t = time.perf_counter()
    for _ in range(steps):
        p = cycle[p]
    return (time.perf_counter() - t) / steps


class CacheProbe:
    """The L3's latency, sampled where a caller likes: between its own steps too (its
    work paused: what a sample shows is the neighbours' share of the cache). A sample
    walks the region (a quarter of the L3 by default) whole, bringing it back into the
    caches after the caller's work evicted it, then times `steps` loads: ~0.2 s here;
    a caller leaves that time out of its own. `step` is the interpreter's own cost of a
    step (the median of three passes over a cycle in the L1), taken off every figure."""

    def __init__(self, cache_mib: int | None = None, steps: int = 200_000,
                 seed: int = 0) -> None:
        self.cache_mib = max(1, l3_mib() // 4) if cache_mib is None else cache_mib
        if self.cache_mib < 1 or steps < 1:
            raise ValueError(f"need cache_mib and steps >= 1, got {self.cache_mib}, {steps}")
        self.steps = steps
        self._cycle = _cycle(self.cache_mib * (1 << 20) // 8, seed)
        small = _cycle(SMALL, seed)
        self.step = statistics.median(_chase(small, steps) for _ in range(3))

    def ns(self, seconds_a_step: float) -> float:
        """A step's time over some region, as the latency of its load (ns)."""
        return round(max(0.0, seconds_a_step - self.step) * 1e9, 1)

    def sample(self) -> float:
        """Nanoseconds a dependent load from the region now."""
        _chase(self._cycle, len(self._cycle))  # every slot once: into the caches
        return self.ns(_chase(self._cycle, self.steps))


def measure(region_mib: int = REGION_MIB, cache_mib: int | None = None,
            steps: int = STEPS, repeats: int = 5, seed: int = 0) -> dict[str, Any]:
    """{"step_ns": the interpreter's own cost of a step, "cache_mib", "cache_load_ns": a
    dependent load's latency from `cache_mib` (CacheProbe's default: a quarter of the
    L3), "region_mib", "load_ns": from `region_mib`}: the median of `repeats` samples
    each (this box's latencies move by tens of percent from one second to the next)."""
    if min(region_mib, steps, repeats) < 1:
        raise ValueError(f"need region_mib, steps and repeats >= 1, got "
                         f"{region_mib}, {steps}, {repeats}")
    probe = CacheProbe(cache_mib, steps, seed)
    near = statistics.median(probe.sample() for _ in range(repeats))
    far = _cycle(region_mib * (1 << 20) // 8, seed)
    _chase(far, min(steps, 10_000))  # its pages faulted in before timing
    return {"step_ns": round(probe.step * 1e9, 1), "cache_mib": probe.cache_mib,
            "cache_load_ns": near, "region_mib": region_mib,
            "load_ns": probe.ns(statistics.median(_chase(far, steps) for _ in range(repeats)))}


def measure_apart(timeout_s: float = 120.0, **kwargs: Any) -> dict[str, Any] | None:
    """`measure` in a process of its own (the caller's peak memory and heap untouched);
    None if it failed."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in kwargs.items()]
    try:
        out = subprocess.run([sys.executable, "-m", "bench.memprobe", "--json", *args],
                             capture_output=True, text=True, timeout=timeout_s, check=True)
        return dict(json.loads(out.stdout))
    except (subprocess.SubprocessError, OSError, ValueError):
        return None


def describe(got: dict[str, Any]) -> str:
    return (f"a dependent load {got['cache_load_ns']:.0f} ns from {got['cache_mib']} MiB "
            f"(inside the L3), {got['load_ns']:.0f} ns from {got['region_mib']} MiB; the "
            f"interpreter's own step {got['step_ns']:.0f} ns")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--region-mib", type=int, default=REGION_MIB)
    p.add_argument("--cache-mib", type=int, default=None,
                   help="the region inside the L3 (default: a quarter of it)")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    got = measure(args.region_mib, args.cache_mib, args.steps, args.repeats)
    print(json.dumps(got) if args.json else describe(got))
    return 0


if __name__ == "__main__":  # what measure_apart runs
    parser = argparse.ArgumentParser(prog="python -m bench.memprobe")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
