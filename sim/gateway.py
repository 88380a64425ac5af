"""The simulated gateway's routing half: the production Locality over the in-process
block index and the production Router, with the registry's view of the simulated
workers. What gateway/core.py does before it sends a request: look the prompt's blocks
up, fill the RouteRequest, route over the registry's candidates; then count the request
in flight on its worker until it completes.

The registry's view: each worker's last load report, this gateway's in-flight counts at
once, as in the gateway (gateway/registry.py). A worker reports when its Load stream's
loop does (worker/service.py, `Load`, with I = `report_interval_s`, worker/config.py
load_interval_ms): after a report it waits for a request to start or end on it, or I at
most, then sleeps I/4 and reports what it holds then. So a report follows a request's
start or end by I/4 (the gateway sees the worker still running a request that ended up
to I/4 ago), and a busy worker's engine progress shows every 5I/4. A report here holds
the worker's figures at the moment it is read, its report time or later when no start
or end came in between (only the engine's progress may differ); reports reach the
gateway at once. I = 0: every route reads every worker now.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine
from operator import attrgetter
from typing import Any

import numpy as np

from gateway.locality import Locality
from gateway.metrics import GatewayMetrics
from gateway.routing.base import CandidateSet, RouteDecision, RouteRequest
from gateway.routing.profile import Router, RoutingProfile
from sim.index import InProcessBlockIndex
from sim.worker import SimWorker

_FREE = attrgetter("num_free_blocks")
_WAITING = attrgetter("waiting")
_RUNNING = attrgetter("running")


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Runs a coroutine that never suspends (the in-process index's lookup) to its end."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a simulated call suspended")


class SimGateway:
    """Owns the Locality (and through it the index's reader side) and the Router; the
    workers are borrowed (their schedulers and pools are read for load reports)."""

    def __init__(self, routing: RoutingProfile, index: InProcessBlockIndex,
                 workers: dict[str, SimWorker], clock: Callable[[], float],
                 report_interval_s: float) -> None:
        self.index = index
        self.locality = Locality(index, GatewayMetrics())  # type: ignore[arg-type]
        self.router = Router(routing)
        self.workers = workers
        self.nodes = frozenset(workers)
        self.clock = clock
        self._inflight: dict[str, int] = dict.fromkeys(workers, 0)
        # what a load report repeats: who, in which role, of what size
        self._workers = list(workers.values())
        self._ids = [w.worker_id for w in self._workers]
        self._roles = [w.role for w in self._workers]
        self._ready = np.ones(len(self._workers), np.bool_)
        self._sizes = np.array([w.kv.pool.num_blocks for w in self._workers], np.int64)
        self._row = {w: i for i, w in enumerate(self._ids)}
        self._pools = [w.kv.pool for w in self._workers]
        self._schedulers = [w.scheduler for w in self._workers]
        # the workers whose step in progress is a decode window that took blocks ahead
        # (the simulator adds them; a report drops those with none ahead any more): the
        # only ones whose free blocks in a report differ from their pool's count now
        self.windows: set[SimWorker] = set()
        # Each worker's Load loop (worker/service.py): after a report it waits up to I for
        # a request to start or end, then sleeps I/4 and reports. `_last`: its last
        # report; `_due`: its next; `_woken`: a start or end set `_due` (not the timeout).
        # The loops' phases are spread over a period, as workers started apart.
        n = len(self._workers)
        self._wait = report_interval_s
        self._period = report_interval_s * 1.25
        self._last = np.array([-self._period * i / n for i in range(n)])
        self._due = self._last + self._period
        self._woken = np.zeros(n, np.bool_)
        self._next_due = float(self._due.min()) if n else math.inf
        self._cands = self._report(0.0)

    def route(self, req: RouteRequest) -> tuple[RouteRequest, RouteDecision]:
        """The request with its locality filled, and where it goes. Raises NoCandidates."""
        lookup = run_sync(self.locality.lookup(req.block_hashes, self.nodes))  # type: ignore[arg-type]
        filled = self.locality.fill(req, lookup)
        return filled, self.router.route(filled, self.candidates())

    def candidates(self) -> CandidateSet:
        """The registry's view now: each worker's last report, this gateway's in-flight
        counts."""
        now = self.clock()
        if self._period == 0:
            self._cands = self._report(now)
        elif now >= self._next_due:
            self._refresh(np.flatnonzero(self._due <= now), now)
            self._next_due = float(self._due.min())
        return self._cands

    def changed(self, worker: SimWorker) -> None:
        """A request started or ended on `worker` (its Generate's start or end, which
        wakes its Load loop): the report due before it goes in first, and the next one
        follows I/4 after it, or at the loop's tick if the loop sleeps towards one."""
        if self._period == 0:
            return
        now = self.clock()
        row = self._row[worker.worker_id]
        if self._due[row] <= now:
            self._refresh(np.array([row]), now)
        if self._woken[row]:
            return  # the loop sleeps towards a report that will hold this too
        last = float(self._last[row])
        tick = last + math.floor((now - last) / self._period) * self._period
        if now - tick < self._wait:  # waiting: woken now
            due = now + self._period - self._wait
            self._woken[row] = True
        else:  # sleeping before the tick's report
            due = tick + self._period
        self._last[row] = tick
        self._due[row] = due
        if due < self._next_due:
            self._next_due = due

    def _refresh(self, rows: np.ndarray, now: float) -> None:
        """The reports of workers `rows` due by `now`, with their figures now (no start
        or end came in between); their loops go on ticking from them. Rows at once: at
        512 workers a route finds ~16 reports due since the last."""
        at = rows.tolist()
        free = list(map(_FREE, map(self._pools.__getitem__, at)))  # at C speed
        if self.windows:  # decode windows took their later iterations' blocks ahead
            for i, r in enumerate(at):
                w = self._workers[r]
                if w in self.windows:
                    if ahead := w.blocks_ahead(now):
                        free[i] += ahead
                    else:  # and none past now: its report is its pool's from now on
                        self.windows.discard(w)
        scheds = list(map(self._schedulers.__getitem__, at))
        counts = np.array(free, np.int64)
        self._cands.set_load(at, list(map(len, map(_WAITING, scheds))),
                             list(map(len, map(_RUNNING, scheds))),
                             1.0 - counts / self._sizes[rows], counts)
        # the ticks since (none held a start or end: the same figures)
        due = self._due[rows]
        last = due + np.floor((now - due) / self._period) * self._period
        self._last[rows] = last
        self._due[rows] = last + self._period
        self._woken[rows] = False

    def _report(self, now: float) -> CandidateSet:
        """Every worker's load report (worker/service.py's LoadReport) at `now`."""
        n = len(self._workers)
        counts = list(map(_FREE, self._pools))
        done = []
        for w in self.windows:  # a decode window took its later iterations' blocks ahead
            if ahead := w.blocks_ahead(now):
                counts[self._row[w.worker_id]] += ahead
            else:  # and none past now: the window's report is its pool's from now on
                done.append(w)
        self.windows.difference_update(done)
        free = np.array(counts, np.int64)
        return CandidateSet.from_columns(
            self._ids, self._ids, self._roles, self._ready,
            np.fromiter(map(len, map(_WAITING, self._schedulers)), np.int64, n),
            np.fromiter(map(len, map(_RUNNING, self._schedulers)), np.int64, n),
            1.0 - free / self._sizes, free, self._sizes,
            np.fromiter(map(self._inflight.__getitem__, self._ids), np.int64, n))

    def window_started(self, worker: SimWorker) -> None:
        """`worker` runs a decode window that took blocks ahead (its reports add them)."""
        self.windows.add(worker)

    def window_ended(self, worker: SimWorker) -> None:
        self.windows.discard(worker)

    def add_inflight(self, worker_id: str, delta: int) -> None:
        self._inflight[worker_id] += delta
        self._cands.set_inflight(worker_id, self._inflight[worker_id])

    def observe(self, decision: RouteDecision, req: RouteRequest, actual: int) -> None:
        """The decode's first response: what it had cached vs the prediction."""
        self.locality.observe(decision.decode.worker_id, decision.predicted_cached(req), actual)
