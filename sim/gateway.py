"""The simulated gateway's routing half: the production Locality over the in-process
block index and the production Router, with the registry's view of the simulated
workers. What gateway/core.py does before it sends a request: look the prompt's blocks
up, fill the RouteRequest, route over the registry's candidates; then count the request
in flight on its worker until it completes.

The registry's view: load reports at most `report_interval_s` old (decode/config.py
load_interval_ms), this gateway's in-flight counts at once, as in the gateway.
"""

from __future__ import annotations

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
        self.report_interval_s = report_interval_s
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
        self._cands = CandidateSet()
        self._reported = -1e30

    def route(self, req: RouteRequest) -> tuple[RouteRequest, RouteDecision]:
        """The request with its locality filled, and where it goes. Raises NoCandidates."""
        lookup = run_sync(self.locality.lookup(req.block_hashes, self.nodes))  # type: ignore[arg-type]
        filled = self.locality.fill(req, lookup)
        return filled, self.router.route(filled, self.candidates())

    def candidates(self) -> CandidateSet:
        """The registry's snapshot: load reports at most `report_interval_s` old, this
        gateway's in-flight counts now."""
        now = self.clock()
        if now - self._reported >= self.report_interval_s:
            self._reported = now
            self._cands = self._report(now)
        return self._cands

    def _report(self, now: float) -> CandidateSet:
        """Every worker's load report (decode/service.py's LoadReport) at `now`."""
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

    def add_inflight(self, worker_id: str, delta: int) -> None:
        self._inflight[worker_id] += delta
        self._cands.set_inflight(worker_id, self._inflight[worker_id])

    def observe(self, decision: RouteDecision, req: RouteRequest, actual: int) -> None:
        """The decode's first response: what it had cached vs the prediction."""
        self.locality.observe(decision.decode.worker_id, decision.predicted_cached(req), actual)
