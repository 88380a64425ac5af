"""Fair sharing between tenants: VTC, the Virtual Token Counter (Sheng et al., OSDI'24,
"Fairness in Serving Large Language Models"), and what each tenant was served.

Each tenant has a counter of the service it received: prompt tokens computed (charged
when scheduled, so one admission round already alternates between tenants) and output
tokens generated, weighted by `input_cost` / `output_cost` and divided by the request's
strategy weight. The scheduler admits the waiting request of the tenant with the
smallest counter. A tenant that joins the queue with nothing waiting has its counter
lifted to the smallest counter of the tenants waiting (or to the counter of the last
tenant to leave the queue when none is): idle time earns no credit, so a returning
tenant cannot starve the others, and the paper's bound on the service difference of
two backlogged tenants holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from engine.request import Request


@dataclass(slots=True)
class TenantServed:
    """Cumulative figures of one tenant (the worker's per-tenant metrics read them)."""

    prompt_tokens: int = 0  # computed here, recomputation after a preemption excluded
    output_tokens: int = 0
    preemptions: int = 0


class FairShare:
    """Owns the counters and the served figures; the scheduler calls `arrive` when a
    request joins the waiting queue, `charge_*` as it is served, `left` when a tenant's
    last waiting request is admitted."""

    def __init__(self, input_cost: float = 1.0, output_cost: float = 2.0) -> None:
        self.input_cost = input_cost
        self.output_cost = output_cost
        self.counters: dict[str, float] = {}
        self.served: dict[str, TenantServed] = {}
        self._last_left: str | None = None

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def arrive(self, tenant: str, waiting_tenants: Iterable[str]) -> None:
        """`tenant` gets a new waiting request; `waiting_tenants`: those of the requests
        already waiting (it may be among them: then nothing changes)."""
        others = set(waiting_tenants)
        if tenant in others:
            return
        if others:
            floor = min(self.counter(t) for t in others)
        elif self._last_left is not None:
            floor = self.counter(self._last_left)
        else:
            floor = 0.0
        self.counters[tenant] = max(self.counter(tenant), floor)

    def left(self, tenant: str) -> None:
        self._last_left = tenant

    def charge_prompt(self, req: Request, num_new_tokens: int) -> None:
        """`num_new_tokens` are scheduled from `req.num_computed_tokens` on; the part of
        the prompt not charged before counts (recomputation is on the house)."""
        end = min(req.num_computed_tokens + num_new_tokens, req.num_prompt_tokens)
        n = end - req.num_prompt_charged
        if n <= 0:
            return
        req.num_prompt_charged = end
        self._served(req.tenant).prompt_tokens += n
        self._add(req, n * self.input_cost)

    def charge_output(self, req: Request, num_tokens: int = 1) -> None:
        self._served(req.tenant).output_tokens += num_tokens
        self._add(req, num_tokens * self.output_cost)

    def charge_outputs(self, reqs: Sequence[Request]) -> None:
        """`charge_output(req)` for each of `reqs` (a step's token each), in order: the
        same counters, one call per step."""
        counters, cost = self.counters, self.output_cost
        for req in reqs:
            t = req.tenant
            counters[t] = counters.get(t, 0.0) + cost / req.policy.weight
        for t, n in Counter(map(attrgetter("tenant"), reqs)).items():
            self._served(t).output_tokens += n

    def preempted(self, req: Request) -> None:
        self._served(req.tenant).preemptions += 1

    def _add(self, req: Request, cost: float) -> None:
        self.counters[req.tenant] = self.counter(req.tenant) + cost / req.policy.weight

    def _served(self, tenant: str) -> TenantServed:
        s = self.served.get(tenant)
        if s is None:
            s = self.served[tenant] = TenantServed()
        return s
