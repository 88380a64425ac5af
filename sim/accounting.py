"""Where a simulation's wall time goes: the production code it exists to run (the
engines' schedulers, KV cache managers and block pools; the gateway's Locality and
Router) against its own (the event loop, decode windows, the workload's block hashes,
the latency model) and the in-process index that stands in for Redis.

`Accounting.install(sim)` wraps the entry points the simulator calls on its workers,
gateway and index (instance attributes: the classes stay as they are) and attributes
every interval to the innermost one running, so a call that calls another is charged
its own time only (the gateway's Locality.lookup runs the index's lookup: that part is
the index's). Whatever runs outside every wrapped call is the simulator's: a decode
window's own steps on the pool (sim/pool.py's peek and unget) among them.

What it answers: the engine and the gateway are not the simulator's to change, so their
share, per request, is a floor under any simulator of them; `sim bench --breakdown`
prints it next to the target.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

CATEGORIES = ("engine", "gateway", "index", "simulator")

# The entry points per object: what sim/cluster.py, sim/worker.py, sim/window.py and
# sim/gateway.py call on the production objects (and on the index, the stand-in for
# Redis).
_SCHEDULER = ("add_request", "schedule", "update_from_output", "finish", "allocate_remote",
              "remote_kv_ready", "release")
_POOL = ("take_events",)  # the rest runs inside the scheduler
_PINS = ("pin", "unpin")
_OFFLOAD = ("save_new", "reap", "run_loads")
_FAIR = ("charge_output",)
_GATEWAY = ("route", "observe")  # the glue around Locality and Router
_INDEX = ("lookup_now", "apply_device", "apply", "defer", "settle")


class Accounting:
    """Seconds per category, exclusive (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        # per wrapped call running, innermost last: [category, since]
        self._stack: list[list[Any]] = []
        self._started = 0.0

    def _wrap(self, obj: Any, names: tuple[str, ...], category: str) -> None:
        stack, seconds, clock = self._stack, self.seconds, self.clock

        def make(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def timed(*args: Any, **kwargs: Any) -> Any:
                now = clock()
                if stack:
                    top = stack[-1]
                    seconds[top[0]] += now - top[1]
                frame: list[Any] = [category, now]
                stack.append(frame)
                try:
                    return fn(*args, **kwargs)
                finally:
                    now = clock()
                    stack.pop()
                    seconds[category] += now - frame[1]
                    if stack:
                        stack[-1][1] = now
            return timed

        for name in names:
            fn = getattr(obj, name, None)
            if fn is None:
                continue
            setattr(obj, name, make(fn))

    def install(self, sim: Any) -> Accounting:
        """Wraps `sim`'s workers' engines, its gateway and its index; returns self."""
        for w in sim.workers.values():
            self._wrap(w.scheduler, _SCHEDULER, "engine")
            self._wrap(w.kv.pool, _POOL, "engine")
            self._wrap(w.pins, _PINS, "engine")
            self._wrap(w.scheduler.fair, _FAIR, "engine")
            if w.offload is not None:
                self._wrap(w.offload, _OFFLOAD, "engine")
        self._wrap(sim.gateway.router, ("route",), "gateway")
        self._wrap(sim.gateway.locality, ("fill", "observe"), "gateway")
        self._wrap(sim.gateway, _GATEWAY, "gateway")
        # the registry's view of the simulated workers (the load reports a gateway
        # receives, and their schedule): the simulator's part of the gateway's route
        self._wrap(sim.gateway, ("candidates", "changed"), "simulator")
        self._wrap(sim.index, _INDEX, "index")
        return self

    def start(self) -> None:
        self._started = self.clock()

    def snapshot(self) -> dict[str, float]:
        """The seconds so far, the simulator's included (call it outside wrapped calls)."""
        out = dict(self.seconds)
        out["simulator"] += max(0.0, self.clock() - self._started - sum(self.seconds.values()))
        return out

    def stop(self) -> None:
        """Ends the run: time outside every wrapped call is the simulator's."""
        wall = self.clock() - self._started
        self.seconds["simulator"] += max(0.0, wall - sum(self.seconds.values()))

    def per_request_us(self, requests: int) -> dict[str, float]:
        n = max(1, requests)
        return {k: round(v / n * 1e6, 1) for k, v in self.seconds.items()}
