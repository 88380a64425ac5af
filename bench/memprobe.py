"""The machine's memory latency, as a reference measured in the same run as a figure
that waits on it: nanoseconds per dependent load from a region far larger than the
CPU's caches (a random cycle through it: each load's address is the last load's value,
so none overlaps another and no prefetcher guesses the next).

What it is for: `splitserve sim bench` at the engine's 16-token blocks spends most of a
late run waiting on such loads (millions of per-block objects touched in no order a
cache follows), and this shared box's memory latency moves with its neighbours: the
same code ran 1.9x slower on one day than on another while the interpreter's own speed
did not move. A sim bench figure reads against the latency measured with it.

Measured from Python (no C compiler needed): the steps over a cycle that fits the L1
cache time the interpreter's own cost of a step; the same steps over the large region
minus that are the loads' latency. The region is a numpy array, which numpy backs with
huge pages where the kernel allows (as the simulator's arenas are), so the figure is the
memory's latency, not page-table walks'. `splitserve bench memory` prints it alone.
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


def measure(region_mib: int = REGION_MIB, steps: int = STEPS, repeats: int = 5,
            seed: int = 0) -> dict[str, Any]:
    """{"load_ns": a dependent load's latency from the region, "step_ns": the
    interpreter's own cost of a step, "region_mib"}: the median of `repeats` passes
    each (this box's latency moves by tens of percent from one second to the next)."""
    if region_mib < 1 or steps < 1 or repeats < 1:
        raise ValueError(f"need region_mib, steps and repeats >= 1, got "
                         f"{region_mib}, {steps}, {repeats}")
    small = _cycle(SMALL, seed)
    step = statistics.median(_chase(small, steps) for _ in range(repeats))
    big = _cycle(region_mib * (1 << 20) // 8, seed)
    _chase(big, min(steps, 10_000))  # its pages faulted in before timing
    far = statistics.median(_chase(big, steps) for _ in range(repeats))
    return {"load_ns": round(max(0.0, far - step) * 1e9, 1), "step_ns": round(step * 1e9, 1),
            "region_mib": region_mib}


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--region-mib", type=int, default=REGION_MIB)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    got = measure(args.region_mib, args.steps, args.repeats)
    if args.json:
        print(json.dumps(got))
    else:
        print(f"a dependent load from {got['region_mib']} MiB: {got['load_ns']:.0f} ns "
              f"(the interpreter's own step: {got['step_ns']:.0f} ns)")
    return 0


if __name__ == "__main__":  # what measure_apart runs
    parser = argparse.ArgumentParser(prog="python -m bench.memprobe")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
