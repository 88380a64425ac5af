"""Figures from a torch.profiler Chrome trace (`export_chrome_trace`), for `bench profile`.

The trace's complete events ("ph": "X", times in µs) are of three kinds here:
host ranges (`user_annotation`: the `record_function` ranges the bench opens), host
ops (`cpu_op`: aten ops; `cuda_runtime` / `cuda_driver`: CUDA API calls) and device
work (`kernel`, `gpu_memcpy`, `gpu_memset`, each tied by `args.correlation` to the API
call that launched it).

A "kernel" is a device kernel (or copy or memset) on CUDA. On the CPU there is no device:
a kernel is a top-level aten op (one not inside another aten op: what a launch is on a
GPU) and device time is the time inside those ops.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

Event = dict[str, Any]
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
API_CATS = ("cuda_runtime", "cuda_driver")


def load(path: str) -> list[Event]:
    """The trace's complete events, by start time."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("ph") == "X" and "dur" in e),
                  key=lambda e: float(e["ts"]))


def ranges(events: Iterable[Event], name: str) -> list[Event]:
    """The host ranges called `name` (record_function), by start time."""
    return [e for e in events if e.get("cat") == "user_annotation" and e["name"] == name]


def within(events: Iterable[Event], outer: Event) -> list[Event]:
    """Events of `outer`'s process that start inside it."""
    t0, t1 = float(outer["ts"]), float(outer["ts"]) + float(outer["dur"])
    return [e for e in events if e.get("pid") == outer.get("pid") and t0 <= float(e["ts"]) < t1]


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """(start, end) intervals merged where they overlap, by start."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def top_level_ops(events: Iterable[Event], tid: Any) -> list[Event]:
    """Thread `tid`'s aten ops that no other aten op encloses (the CPU's launches)."""
    out: list[Event] = []
    end = float("-inf")
    for e in events:
        if e.get("cat") != "cpu_op" or e.get("tid") != tid:
            continue
        if float(e["ts"]) >= end:
            out.append(e)
            end = float(e["ts"]) + float(e["dur"])
    return out


class DeviceWork:
    """A trace's device events, each found by the host time of the call that launched
    it (so a kernel belongs to the step that launched it, wherever it ran)."""

    def __init__(self, events: list[Event]) -> None:
        launch_ts = {e["args"]["correlation"]: float(e["ts"]) for e in events
                     if e.get("cat") in API_CATS and "correlation" in e.get("args", {})}
        self.items = [(launch_ts[e["args"]["correlation"]], e) for e in events
                      if e.get("cat") in DEVICE_CATS
                      and e.get("args", {}).get("correlation") in launch_ts]
        self.cuda = bool(self.items) or any(e.get("cat") in API_CATS for e in events)

    def launched_in(self, outer: Event) -> list[Event]:
        t0, t1 = float(outer["ts"]), float(outer["ts"]) + float(outer["dur"])
        return [e for ts, e in self.items if t0 <= ts < t1]


def busy_and_gaps(kernels: list[Event]) -> tuple[float, float, float]:
    """(busy µs: the union of the kernels' times, sum of the idle gaps between them,
    the largest gap)."""
    spans = merged((float(k["ts"]), float(k["ts"]) + float(k["dur"])) for k in kernels)
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:], strict=False)]
    return sum(e - s for s, e in spans), sum(gaps), max(gaps, default=0.0)


def _waits(inside: list[Event]) -> float:
    """µs the host spent blocked on the device (synchronising API calls)."""
    return sum(e - s for s, e in merged(
        (float(x["ts"]), float(x["ts"]) + float(x["dur"])) for x in inside
        if x.get("cat") in API_CATS and "Synchronize" in x["name"]))


def step_figures(events: list[Event], step: Event, work: DeviceWork,
                 phases: Iterable[str]) -> dict[str, Any]:
    """One step's figures: wall, host and device µs, kernels, launch calls, device idle
    gaps between its kernels, and the host µs of each phase range inside it."""
    inside = within(events, step)
    if work.cuda:
        kernels = work.launched_in(step)
        launch_calls = sum(1 for e in inside if e.get("cat") in API_CATS
                           and "Launch" in e["name"])
    else:
        kernels = top_level_ops(inside, step.get("tid"))
        launch_calls = len(kernels)
    busy, gap_sum, gap_max = busy_and_gaps(kernels)
    wall = float(step["dur"])
    # CUDA: the host is busy except while it waits on the device; CPU: except in the ops
    host = wall - (_waits(inside) if work.cuda else busy)
    return {"wall_us": wall, "host_us": host, "device_us": busy, "kernels": len(kernels),
            "launch_calls": launch_calls, "gap_sum_us": gap_sum, "gap_max_us": gap_max,
            "phases_us": exclusive_phases(inside, phases)}


def exclusive_phases(events: list[Event], phases: Iterable[str]) -> dict[str, float]:
    """µs per phase range name, each range less the phase ranges inside it (an async
    step's resolve holds its outputs and the read of its tokens): they sum to at most
    the time the ranges cover."""
    phases = list(phases)
    spans = sorted(((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
                    for p in phases for e in ranges(events, p)), key=lambda x: (x[0], -x[1]))
    out = dict.fromkeys(phases, 0.0)
    open_: list[list[Any]] = []  # open ranges: [end, name, µs of its children, µs]
    for t0, t1, name in spans:
        while open_ and open_[-1][0] <= t0:
            _close(open_, out)
        open_.append([t1, name, 0.0, t1 - t0])
    while open_:
        _close(open_, out)
    return out


def _close(open_: list[list[Any]], out: dict[str, float]) -> None:
    end, name, inner, dur = open_.pop()
    out[name] += dur - inner
    if open_:
        open_[-1][2] += dur


def top_kernels(steps: list[Event], events: list[Event], work: DeviceWork,
                n: int = 12) -> list[dict[str, Any]]:
    """The `n` kernels (by name) taking the most device time over `steps`: µs and
    launches per step (CPU: the top-level aten ops and their time)."""
    time: dict[str, float] = {}
    count: dict[str, int] = {}
    for step in steps:
        kernels = (work.launched_in(step) if work.cuda
                   else top_level_ops(within(events, step), step.get("tid")))
        for k in kernels:
            time[k["name"]] = time.get(k["name"], 0.0) + float(k["dur"])
            count[k["name"]] = count.get(k["name"], 0) + 1
    per = max(1, len(steps))
    return [{"name": name, "us_per_step": t / per, "per_step": count[name] / per}
            for name, t in sorted(time.items(), key=lambda kv: -kv[1])[:n]]


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return (s[n // 2] + s[(n - 1) // 2]) / 2 if n else 0.0


def summarize_steps(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over steps of every figure (phases too)."""
    if not steps:
        return {}
    keys = [k for k in steps[0] if isinstance(steps[0][k], (int, float))]
    out: dict[str, Any] = {k: median([s[k] for s in steps]) for k in keys}
    out["phases_us"] = {p: median([s["phases_us"][p] for s in steps])
                        for p in steps[0]["phases_us"]}
    out["steps"] = len(steps)
    return out


# -- the KV hand-off (sender side) -------------------------------------------------------

FRAMES = ("RESERVE", "WRITTEN", "WRITE", "FINISH")  # the frames a hand-off sends


def mean_us(events: list[Event], name: str) -> float:
    """Mean duration of the `name` ranges (0 without any)."""
    found = ranges(events, name)
    return sum(float(e["dur"]) for e in found) / len(found) if found else 0.0


def handoff_figures(events: list[Event], work: DeviceWork, nbytes: int) -> dict[str, Any]:
    """Per hand-off (means over the `handoff` ranges): chunks (`kv.write` ranges), control
    frames sent (`wire.<KIND>`), round trips (a RESERVE in a chunk awaits a GRANT,
    `kv.finish` the verdict, sent unasked to every writer: tcp's WRITE frames and an
    in-place transport's grant make the sender one; the grant begun before the range
    is not counted here), copy
    µs (`kv.copy`, tcp's `kv.send_regions`; on CUDA at least the device time of what the
    hand-off launched) and the fixed rest of the wall time."""
    outer = ranges(events, "handoff")
    if not outer:
        return {}
    rows: list[dict[str, Any]] = []
    for h in outer:
        inside = within(events, h)
        count = {k: len(ranges(inside, f"wire.{k}")) for k in FRAMES}
        chunks = len(ranges(inside, "kv.write"))
        copies = ranges(inside, "kv.copy") or ranges(inside, "kv.send_regions")
        host_copy = sum(float(e["dur"]) for e in copies)
        device, _, _ = busy_and_gaps(work.launched_in(h)) if work.cuda else (0.0, 0.0, 0.0)
        copy = max(host_copy, device)
        rows.append({"wall_us": float(h["dur"]), "chunks": chunks,
                     "round_trips": count["RESERVE"] + len(ranges(inside, "kv.finish")),
                     "round_trips_per_chunk": count["RESERVE"] / max(chunks, 1),
                     "notices_per_chunk": count["WRITTEN"] / max(chunks, 1),
                     "frames": count, "copy_us": copy, "device_us": device,
                     "fixed_us": float(h["dur"]) - copy,
                     "finish_wait_us": sum(float(e["dur"]) for e in ranges(inside, "kv.finish"))})
    n = len(rows)
    mean = {k: sum(r[k] for r in rows) / n for k in rows[0] if k != "frames"}
    wall_s = mean["wall_us"] / 1e6
    return {**mean, "handoffs": n, "bytes": nbytes,
            "gbps": nbytes / wall_s / 1e9 if wall_s else 0.0,
            "frames": {k: sum(r["frames"][k] for r in rows) / n for k in FRAMES},
            "per_handoff": rows}


def receiver_figures(events: list[Event], names: Iterable[str]) -> dict[str, Any]:
    """Per hand-off (means over the receiver's `handoff` ranges): how many times and how
    many µs each handler range ran."""
    outer = ranges(events, "handoff")
    if not outer:
        return {}
    out: dict[str, Any] = {"handoffs": len(outer)}
    for name in names:
        found = [ranges(within(events, h), name) for h in outer]
        out[name] = {"calls": sum(map(len, found)) / len(outer),
                     "us": sum(float(e["dur"]) for f in found for e in f) / len(outer)}
    return out
