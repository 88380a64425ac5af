"""Admission control: a request is dispatched to a worker only while some worker has
room; otherwise it waits in one bounded gateway queue, and waiting requests are
released in a fair order across tenants.

Room (`WorkerSlots`): a decode/colocated worker has room while its waiting queue is
shorter than `max_waiting_per_worker` and its KV usage leaves `kv_headroom` free. Its
queue is what its last load report says, or — when this gateway has more calls open
on it than the report shows running — that excess (reports lag by an interval).
Requests admitted but not yet in a worker call (routing, index lookup) hold a slot too.

Order (`AdmissionQueue`): the Virtual Token Counter of Sheng et al., "Fairness in
Serving Large Language Models" (OSDI'24), across this gateway's tenants. Each tenant
has a counter of the service it received — prompt tokens x INPUT_COST when dispatched,
output tokens x OUTPUT_COST as they stream — divided by its strategy weight; the
waiting request of the tenant with the smallest counter goes next. A tenant that starts
waiting is lifted to the smallest counter of the tenants already waiting (or to the
last dispatched tenant's, when none is), so idle time earns no credit. Requests a
`priority` strategy selects go before all others; a tenant at its `max_running`
waits; within a tenant, vLLM's `priority` (lower first), then arrival.

When the queue is full, the tenant with the most waiting requests loses its newest
one (429) to make room — a flooding tenant cannot crowd the others out of the queue.
A waiting request leaves with 504 at its deadline, or when its caller goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.strategies import EMPTY, Policy, StrategySet
from gateway.errors import Overloaded, UpstreamTimeout
from gateway.routing.base import Candidate

if TYPE_CHECKING:
    from gateway.metrics import GatewayMetrics
    from gateway.registry import WorkerRegistry

INPUT_COST = 1.0  # VTC's w_p: one prompt token
OUTPUT_COST = 2.0  # VTC's w_q: one generated token (the paper's 1:2)
SERVING_ROLES = ("decode", "colocated")


class Slots(Protocol):
    def free(self, outstanding: int) -> int:
        """How many more requests may be dispatched now, when `outstanding` requests
        admitted by this gateway have not finished."""


class WorkerSlots:
    """Room on the registry's workers (see the module docstring)."""

    def __init__(self, registry: WorkerRegistry, max_waiting: int, kv_headroom: float,
                 ) -> None:
        self.registry = registry
        self.max_waiting = max_waiting
        self.kv_headroom = kv_headroom

    def room(self, c: Candidate) -> int:
        if self.kv_headroom > 0 and c.kv_usage > 1.0 - self.kv_headroom:
            return 0
        waiting = max(c.num_waiting, c.inflight - c.num_running)
        return max(0, self.max_waiting - waiting)

    def free(self, outstanding: int) -> int:
        serving = [c for c in self.registry.candidates() if c.role in SERVING_ROLES]
        pending = max(0, outstanding - self.registry.inflight_total())
        return sum(self.room(c) for c in serving) - pending

    def eligible(self, candidates: list[Candidate]) -> list[Candidate]:
        """The candidates to route to: serving workers without room are left out,
        unless none has room (a request already admitted is routed, not failed)."""
        keep = [c for c in candidates if c.role not in SERVING_ROLES or self.room(c) > 0]
        return keep if any(c.role in SERVING_ROLES for c in keep) else candidates


@dataclass(eq=False)
class Ticket:
    """A dispatched request's hold on a slot and its tenant's share. The caller
    reports output as it streams (`charge`) and calls `release` exactly once."""

    queue: AdmissionQueue
    tenant: str
    policy: Policy
    queue_s: float = 0.0
    output_tokens: int = 0
    released: bool = False

    def charge(self, num_output_tokens: int) -> None:
        """`num_output_tokens`: the request's total so far (deltas are derived)."""
        delta = num_output_tokens - self.output_tokens
        if delta > 0:
            self.output_tokens = num_output_tokens
            self.queue.serve(self.tenant, delta * OUTPUT_COST / self.policy.weight)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.queue.finish(self)


@dataclass(eq=False)
class _Waiter:
    seq: int
    tenant: str
    labels: Mapping[str, str]
    request_id: str
    policy: Policy
    priority: int  # vLLM's: lower first
    prompt_tokens: int
    since: float
    future: asyncio.Future[Ticket] = field(repr=False)


class AdmissionQueue:
    """Owns the waiting requests, the tenants' counters and their running counts."""

    def __init__(self, slots: Slots, max_waiting: int, strategies: StrategySet = EMPTY,
                 fair: bool = True, metrics: GatewayMetrics | None = None,
                 poll_s: float = 0.02, clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = slots
        self.fair = fair  # False: arrival order (FCFS), the baseline VTC is measured against
        self.max_waiting = max_waiting
        self.strategies = strategies
        self.metrics = metrics
        self.poll_s = poll_s  # re-check room this often while requests wait
        self.clock = clock
        self.counters: dict[str, float] = {}
        self.running: dict[str, int] = {}
        self.outstanding = 0
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()
        self._last_counter = 0.0  # counter of the tenant dispatched last
        self._grants: deque[float] = deque(maxlen=64)
        self._poller: asyncio.Task[None] | None = None

    # -- the caller's side ---------------------------------------------------------------
    async def admit(self, tenant: str, labels: Mapping[str, str], request_id: str,
                    priority: int, prompt_tokens: int, deadline: float) -> Ticket:
        """Returns a Ticket once the request may go to a worker. Overloaded (429, with
        retry_after) when the queue is full, UpstreamTimeout (504) at the deadline."""
        policy = self.strategies.for_request(tenant, labels, request_id)
        w = _Waiter(next(self._seq), tenant, labels, request_id, policy, priority,
                    prompt_tokens, self.clock(), asyncio.get_running_loop().create_future())
        self._enqueue(w)
        self.pump()
        if len(self._waiting) > self.max_waiting:
            self._shed()
        if not w.future.done():
            self._ensure_poller()
            try:
                await asyncio.wait({w.future}, timeout=max(0.0, deadline - self.clock()))
            except BaseException:  # the caller went away: give back what it holds
                self._abandon(w)
                raise
            if not w.future.done():
                self._abandon(w)
                raise UpstreamTimeout("the request's deadline passed while it waited for a "
                                      "worker (the gateway's admission queue)")
        return w.future.result()

    def retry_after(self) -> int:
        """Seconds until the queue has likely drained by one queue's worth: from the
        recent dispatch rate, between 1 and 60."""
        if len(self._grants) < 2 or self._grants[-1] <= self._grants[0]:
            return 1
        rate = (len(self._grants) - 1) / (self._grants[-1] - self._grants[0])
        return int(min(60, max(1, math.ceil(len(self._waiting) / rate))))

    def set_strategies(self, strategies: StrategySet) -> None:
        """New strategies apply to requests that arrive after this call and to the
        waiting ones (their policy is looked up again)."""
        self.strategies = strategies
        for w in self._waiting:
            w.policy = strategies.for_request(w.tenant, w.labels, w.request_id)
        self.pump()

    # -- state changes -------------------------------------------------------------------
    def serve(self, tenant: str, cost: float) -> None:
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost

    def finish(self, ticket: Ticket) -> None:
        self.outstanding -= 1
        self.running[ticket.tenant] -= 1
        if not self.running[ticket.tenant]:
            del self.running[ticket.tenant]
        self.pump()

    def pump(self) -> None:
        """Dispatches waiting requests, in order, while there is room."""
        free = self.slots.free(self.outstanding) if self._waiting else 0
        while free > 0:
            w = self._next()
            if w is None:
                break
            self._grant(w)
            free -= 1
        if self.metrics is not None:
            self.metrics.admission_waiting.set(len(self._waiting))

    def waiting(self) -> int:
        return len(self._waiting)

    def _key(self, w: _Waiter) -> tuple[bool, float, int, int]:
        if not self.fair:
            return (not w.policy.priority, 0.0, 0, w.seq)
        return (not w.policy.priority, self.counters.get(w.tenant, 0.0), w.priority, w.seq)

    def _next(self) -> _Waiter | None:
        ready = (w for w in self._waiting if w.policy.max_running is None
                 or self.running.get(w.tenant, 0) < w.policy.max_running)
        return min(ready, key=self._key, default=None)

    def _grant(self, w: _Waiter) -> None:
        self._waiting.remove(w)
        now = self.clock()
        self.serve(w.tenant, w.prompt_tokens * INPUT_COST / w.policy.weight)
        self._last_counter = self.counters[w.tenant]
        self.running[w.tenant] = self.running.get(w.tenant, 0) + 1
        self.outstanding += 1
        self._grants.append(now)
        w.future.set_result(Ticket(self, w.tenant, w.policy, queue_s=now - w.since))

    def _enqueue(self, w: _Waiter) -> None:
        if not any(o.tenant == w.tenant for o in self._waiting):  # VTC's counter lift
            others = [self.counters.get(o.tenant, 0.0) for o in self._waiting]
            floor = min(others) if others else self._last_counter
            self.counters[w.tenant] = max(self.counters.get(w.tenant, 0.0), floor)
        self._waiting.append(w)
        self._forget_idle()

    def _shed(self) -> None:
        """Over the bound: the tenant with the most waiting (ties: the most served)
        gives up its newest request — the newcomer itself when it is that tenant's."""
        counts = Counter(o.tenant for o in self._waiting)
        top = max(counts, key=lambda t: (counts[t], self.counters.get(t, 0.0)))
        victim = max((o for o in self._waiting if o.tenant == top), key=lambda o: o.seq)
        self._waiting.remove(victim)
        if self.metrics is not None:
            self.metrics.admission_waiting.set(len(self._waiting))
        victim.future.set_exception(Overloaded(
            "every worker is busy and the admission queue is full; retry later",
            retry_after=self.retry_after()))

    def _abandon(self, w: _Waiter) -> None:
        if w in self._waiting:
            self._waiting.remove(w)
        elif w.future.done() and not w.future.cancelled() and w.future.exception() is None:
            w.future.result().release()  # granted while the caller was leaving
        self.pump()

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        """Load reports change the room without telling the queue: look again."""
        while self._waiting:
            await asyncio.sleep(self.poll_s)
            self.pump()

    def _forget_idle(self) -> None:
        """Counters of tenants neither waiting nor running, at or below the floor a
        returning tenant is lifted to, change nothing: drop them (bounded memory)."""
        if len(self.counters) < 1024:
            return
        active = {o.tenant for o in self._waiting} | set(self.running)
        floor = min((self.counters[t] for t in active), default=self._last_counter)
        for t in [t for t, c in self.counters.items() if t not in active and c <= floor]:
            del self.counters[t]

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

