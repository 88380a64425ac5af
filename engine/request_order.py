"""The orders a scheduler's policy puts requests in: which waiting request is admitted
next, and which running request is preempted first when blocks, seats or budget run out.

Policies: `fcfs` (arrival), `priority` (the request's `priority` value, lower first), or
`vtc` (fair sharing between tenants, engine/fairness.py). Under every policy the requests
a `priority: true` strategy selects (engine/strategies.py) rank before the rest, waiting
and running. The orders read the requests and the tenants' counters; they change nothing.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Iterator

from engine.fairness import FairShare
from engine.request import Request


def rank(r: Request) -> int:
    """0 for requests a `priority` strategy selects, 1 for the rest."""
    return 0 if r.policy.priority else 1


def capped(r: Request, running: Counter[str]) -> bool:
    """True when `r`'s tenant already runs its strategy's `max_running` requests
    (`running`: running requests per tenant)."""
    cap = r.policy.max_running
    return cap is not None and running[r.tenant] >= cap


class RequestOrder:
    """The policy's orders over requests; `fair` holds the VTC counters (read only)."""

    def __init__(self, policy: str, fair: FairShare) -> None:
        self.policy = policy
        self.fair = fair

    def _priority(self, r: Request) -> float:
        return float(r.priority) if self.policy == "priority" else 0.0

    def waiting_key(self, r: Request) -> tuple[int, float, float]:
        """Sort key of the waiting line (smallest first) for the fcfs and priority
        policies; under vtc it orders each tenant's own queue."""
        return (rank(r), self._priority(r), r.queued_time)

    def admission(self, ready: Iterable[Request]) -> Iterator[Request]:
        """`ready` waiting requests in the order the policy admits them. Lazy: under VTC
        each pick goes to the tenant whose counter is smallest now, after the charges of
        the picks before it."""
        ordered = sorted(ready, key=self.waiting_key)
        if self.policy != "vtc":
            yield from ordered
            return
        queues: dict[str, deque[Request]] = {}
        for r in ordered:
            queues.setdefault(r.tenant, deque()).append(r)
        while queues:
            tenant = min(queues, key=lambda t: (rank(queues[t][0]), self.fair.counter(t),
                                                queues[t][0].queued_time))
            q = queues[tenant]
            yield q.popleft()
            if not q:
                del queues[tenant]

    def victim(self, candidates: Iterable[Request]) -> Request:
        """The running request to preempt first among `candidates` (not empty)."""
        # Requests without a priority strategy go first; least progressed loses the least
        # work; under the priority policy the lowest priority (largest value) goes first,
        # latest arrival breaking ties.
        def badness(r: Request) -> tuple[int, float, int, float]:
            return (rank(r), self._priority(r), -r.num_computed_tokens, r.arrival_time)
        return max(candidates, key=badness)
