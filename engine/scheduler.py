"""Continuous-batching scheduler (vLLM v1's model).

Each step hands out a token budget: running requests first (one token each when
decoding, a chunk when still prefilling), then waiting requests, whose prompts are
chunked to fit. When blocks run out, the least-progressed running request is
preempted: its blocks are freed and it is recomputed later.

Waiting requests are admitted, and running ones preempted, in the policy's order
(engine/request_order.py: `fcfs`, `priority` or `vtc`). Scheduling strategies
(engine/strategies.py) act under every policy: `priority: true` requests come first,
running and waiting, and preempt lower ones when blocks, seats or the token budget are
short; `max_running` caps a tenant's running requests; a request that ran its
`execution_time` slice while a request of its rank was left waiting yields its place (a
preemption whose full blocks stay in the prefix cache) and rejoins the back of the line.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from engine.block_pool import KVBlock
from engine.config import SchedulerConfig
from engine.fairness import FairShare, TenantServed
from engine.kv_cache_manager import KVCacheManager
from engine.offload import OffloadConnector
from engine.request import Request, RequestStatus
from engine.request_order import RequestOrder, capped, rank
from engine.strategies import EMPTY, StrategySet


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens to compute this step, from num_computed_tokens on


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int  # cumulative
    kv_usage: float
    num_free_blocks: int
    num_blocks: int
    prefix_cache_queries: int  # cumulative tokens
    prefix_cache_hits: int  # cumulative tokens
    tenants: Mapping[str, TenantServed] = field(default_factory=dict)  # cumulative
    strategies_version: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 offload: OffloadConnector | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kv = kv
        self.offload = offload  # external KV tiers (host, disk, ...), if any
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # finished producers whose KV is being sent
        self.num_preemptions = 0
        self.clock = clock  # time slices and waiting order (tests pass a step clock)
        self.fair = FairShare(config.vtc_input_cost, config.vtc_output_cost)
        self.order = RequestOrder(config.policy, self.fair)
        self.strategies = EMPTY
        self._left_waiting: Counter[int] = Counter()  # rank -> ready requests left waiting

    def set_strategies(self, strategies: StrategySet) -> None:
        """Applies a new strategy set to every request, from the next `schedule` on."""
        self.strategies = strategies
        for r in self.requests.values():
            self._apply_policy(r)

    def _apply_policy(self, r: Request) -> None:
        r.policy = self.strategies.for_request(r.tenant, r.labels, r.client_id or r.request_id)

    def _enqueue(self, request: Request) -> None:
        """A new request joins the waiting line (VTC lifts its tenant's counter)."""
        self._apply_policy(request)
        request.queued_time = self.clock()
        self.fair.arrive(request.tenant, (r.tenant for r in self.waiting))
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_request(self, request: Request) -> None:
        self._enqueue(request)

    def has_work(self) -> bool:
        return bool(self.running or any(r.status != RequestStatus.WAITING_FOR_REMOTE_KV
                                        for r in self.waiting))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = self.clock()
        yielded = self._yield_slices(now)
        if self.strategies.strategies:  # (without any, no request ranks first)
            self.running.sort(key=rank)  # stable: priority strategies first, else as before
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = req.num_tokens - req.num_computed_tokens
            if req.num_output_placeholders:  # async scheduling: tokens still being sampled
                if req.num_output_tokens + req.num_output_placeholders \
                        >= req.sampling_params.max_tokens:
                    i += 1  # the token in flight is its last
                    continue
                n += req.num_output_placeholders
            n = min(n, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.order.victim(self.running[i:])
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n))
                if req.num_prompt_charged < req.num_prompt_tokens:  # (decode: charged)
                    self.fair.charge_prompt(req, n)
                budget -= n
                i += 1
        if not self.waiting:  # most steps: only running requests, nothing left waiting
            self._left_waiting.clear()
            return out
        if not out.preempted:
            self._admit_waiting(out, budget, yielded, now)
        running = Counter(r.tenant for r in self.running)
        self._left_waiting = Counter(rank(r) for r in self._ready()
                                     if not capped(r, running))
        return out

    def _ready(self, skip: Collection[Request] = ()) -> Iterator[Request]:
        # (a preempted request whose token is still in flight waits for it)
        return (r for r in self.waiting
                if r.status != RequestStatus.WAITING_FOR_REMOTE_KV and r not in skip
                and not r.num_output_placeholders)

    def _admit_waiting(self, out: SchedulerOutput, budget: int,
                       skip: Collection[Request], now: float) -> None:
        running = Counter(r.tenant for r in self.running)
        admitted: list[Request] = []
        blocked = False  # a request did not fit: order is kept, but see below
        for req in self.order.admission(self._ready(skip)):
            if capped(req, running):
                continue
            if blocked and not self.kv.holds(req.request_id):
                continue
            n = self._try_admit(req, budget)
            while n is None and (got := self._preempt_lower(req, out)) is not None:
                victim, refund = got
                running[victim.tenant] -= 1
                budget += refund
                n = self._try_admit(req, budget)
            if n is None:
                # Head-of-line: later requests wait for room in order, except those that
                # already hold their KV (it arrived from a prefill or peer, or a fork's
                # shared prompt): they need at most a block, and running them is what
                # frees blocks. Held back, they could hold the very blocks the head
                # waits for, with nothing running to free any (a stalled worker).
                blocked = True
                continue
            req.status = RequestStatus.RUNNING
            req.slice_start = now
            if req.scheduled_time is None:
                req.scheduled_time = now
            self.running.append(req)
            admitted.append(req)
            running[req.tenant] += 1
            out.scheduled.append(ScheduledRequest(req, n))
            self.fair.charge_prompt(req, n)
            budget -= n
        for req in admitted:
            self.waiting.remove(req)
        waiting_tenants = {r.tenant for r in self.waiting}
        for req in admitted:
            if req.tenant not in waiting_tenants:
                self.fair.left(req.tenant)

    def _try_admit(self, req: Request, budget: int) -> int | None:
        """Allocates `req`'s blocks and returns how many tokens it computes this step, or
        None (nothing changed) when the budget, a seat or the blocks are short."""
        if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            return None
        blocks: list[KVBlock] = []
        ext = 0  # blocks loaded from the external tiers into new blocks
        if self.kv.holds(req.request_id):  # its KV arrived (or was hit) remotely
            num_hit = req.num_computed_tokens
        else:
            blocks, num_hit = self.kv.get_computed_blocks(req)
            ext = self.offload.match(req, len(blocks)) if self.offload else 0
        # | device hit | external hit (loaded) | new tokens (computed) |
        n = req.num_tokens - num_hit - ext * self.kv.block_size
        if n > budget and not self.config.enable_chunked_prefill:
            return None
        n = min(n, budget)
        if not self.kv.allocate_slots(req, n + ext * self.kv.block_size, blocks):
            return None
        if ext:
            self._plan_load(req, len(blocks), ext)
            num_hit += ext * self.kv.block_size
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_hit
        return n

    def _preempt_lower(self, req: Request, out: SchedulerOutput) -> tuple[Request, int] | None:
        """Makes room for `req` by preempting a running request of lower rank (taking it
        out of this step); returns it and the budget it gave back, or None if none."""
        lower = [r for r in self.running if rank(r) > rank(req)]
        if not lower:
            return None
        victim = self.order.victim(lower)
        refund = 0
        for s in out.scheduled:
            if s.request is victim:
                out.scheduled.remove(s)
                refund = s.num_new_tokens
                break
        self._preempt(victim)
        out.preempted.append(victim)
        return victim, refund

    def _yield_slices(self, now: float) -> set[Request]:
        """Decoding requests whose `execution_time` slice is over give their place, one
        for each request of their rank left waiting by the last step."""
        yielded: set[Request] = set()
        for level, num_waiting in self._left_waiting.items():
            over = sorted((r for r in self.running if rank(r) == level
                           and r.policy.execution_time_ns is not None
                           and r.num_computed_tokens >= r.num_prompt_tokens
                           and (now - r.slice_start) * 1e9 >= r.policy.execution_time_ns),
                          key=lambda r: r.slice_start)
            for r in over[:num_waiting]:
                self._preempt(r, yielded=True)
                r.queued_time = now  # the back of the line
                yielded.add(r)
        return yielded

    def _plan_load(self, req: Request, first: int, num: int) -> None:
        assert self.offload is not None
        self.offload.plan_load(req, self.kv.block_ids(req.request_id), first, num)
        self.kv.prefix_hits += num * self.kv.block_size

    def load_failed(self, out: SchedulerOutput, req: Request, num_lost_tokens: int) -> None:
        """Part of a planned load did not land (tier error, evicted meanwhile): those
        tokens are computed this step instead (their blocks are already allocated)."""
        req.num_computed_tokens -= num_lost_tokens
        if req.num_cached_tokens is not None:
            req.num_cached_tokens = min(req.num_cached_tokens, req.num_computed_tokens)
        self.kv.prefix_hits -= num_lost_tokens
        for s in out.scheduled:
            if s.request is req:
                s.num_new_tokens += num_lost_tokens

    # -- remote prefill (decode side) -------------------------------------------------
    def allocate_remote(self, req: Request) -> bool:
        """Takes local prefix hits and allocates blocks for the rest of the prompt, then
        parks the request in WAITING_FOR_REMOTE_KV while another node fills them.

        Returns False (nothing changed) when the blocks are not free now.
        """
        blocks, num_hit = self.kv.get_computed_blocks(req)
        ext = self.offload.match(req, len(blocks)) if self.offload else 0
        if not self.kv.allocate_slots(req, req.num_tokens - num_hit, blocks):
            return False
        if ext:  # the engine loads them before the remote prefill is asked for the rest
            self._plan_load(req, len(blocks), ext)
            num_hit += ext * self.kv.block_size
        req.num_computed_tokens = num_hit
        req.num_cached_tokens = num_hit
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._enqueue(req)
        return True

    def remote_kv_ready(self, req: Request, first_token: int | None,
                        num_computed_tokens: int | None = None,
                        logprobs: dict[int, float] | None = None) -> None:
        """Makes a parked request runnable. With `first_token`, the whole prompt's KV
        has landed in its blocks and the token came from the remote sampler; with None
        the rest of the prompt is computed here from `num_computed_tokens` (KV a peer
        wrote; block aligned, below the prompt's length) or from the local hit (blocks
        past it are simply overwritten)."""
        if req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise RuntimeError(f"request {req.request_id} is not waiting for remote KV")
        if first_token is not None:
            if num_computed_tokens:  # the part that came from caches (a peer's) is cached
                req.num_cached_tokens = max(req.num_cached_tokens or 0, num_computed_tokens)
            req.num_computed_tokens = req.num_tokens
            self.kv.cache_blocks(req, req.num_computed_tokens)
            req.append_token(first_token, logprobs)
        elif num_computed_tokens is not None and num_computed_tokens > req.num_computed_tokens:
            if num_computed_tokens % self.kv.block_size or num_computed_tokens >= req.num_tokens:
                raise RuntimeError(f"bad remote KV extent {num_computed_tokens} for "
                                   f"{req.request_id} ({req.num_tokens} tokens)")
            # | local hit | pulled from a peer | computed here |
            req.num_computed_tokens = req.num_cached_tokens = num_computed_tokens
            self.kv.cache_blocks(req, num_computed_tokens)
        # KV computed elsewhere is not service of this scheduler (VTC charges none of it)
        req.num_prompt_charged = max(req.num_prompt_charged,
                                     min(req.num_computed_tokens, req.num_prompt_tokens))
        req.status = RequestStatus.WAITING

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Queues `child`, a parallel sample of `parent`'s prompt holding its first
        token, on the parent's computed prompt KV (shared blocks, engine/kv_cache_manager
        `fork`); it is admitted like a request whose KV arrived. Without a free block for
        the copy it waits like a preempted request (recomputed, prefix hits apply).
        Returns the block copy (source, destination) the runner must make, if any.
        Under async scheduling the parent may have computed its first token (or been
        preempted) meanwhile: the child takes the KV before it (or recomputes)."""
        self.requests[child.request_id] = child
        self.waiting.append(child)
        # the parent's place in line and policy; its prompt was charged once (VTC)
        child.policy, child.queued_time = parent.policy, parent.queued_time
        child.num_prompt_charged = parent.num_prompt_charged
        if not self.kv.can_fork() or not self.kv.holds(parent.request_id):
            child.status = RequestStatus.PREEMPTED
            return None
        n = min(parent.num_computed_tokens, parent.num_tokens - 1)  # not its own output
        child.num_computed_tokens = n
        child.num_cached_tokens = parent.num_cached_tokens
        return self.kv.fork(parent, child, n)

    def release(self, request_id: str) -> bool:
        """Frees a finished producer's held blocks. False if none are held."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(req)
        return True

    def _preempt(self, req: Request, yielded: bool = False) -> None:
        """Frees `req`'s blocks (its full ones stay in the prefix cache) and puts it back
        in the waiting line to be recomputed; a time-slice yield is not a preemption."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        if not yielded:
            req.num_preemptions += 1
            self.num_preemptions += 1
            self.fair.preempted(req)
        self.waiting.append(req)

    def update_from_output(self, out: SchedulerOutput,
                           sampled: Mapping[str, tuple[int, Any]]) -> list[Request]:
        """Advances computed tokens, appends sampled tokens, caches full blocks.

        Returns the requests that received a new token this step.
        """
        got_token = []
        along = getattr(sampled, "along", None)  # (engine.outputs.SampledTokens)
        if along is not None:
            tokens, lps = along(out.scheduled)
        else:
            gots = [sampled.get(s.request.request_id) for s in out.scheduled]
            tokens = [None if g is None else g[0] for g in gots]
            lps = [None if g is None else g[1] for g in gots]
        for s, tok, lp in zip(out.scheduled, tokens, lps, strict=True):
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_blocks(req, req.num_computed_tokens)
            if tok is not None:
                req.append_token(tok, lp)
                got_token.append(req)
        self.fair.charge_outputs(got_token)
        return got_token

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request wherever it is and frees its blocks. None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.hold_kv and status != RequestStatus.FINISHED_ABORTED:
            self.held[request_id] = req
        else:
            self.kv.free(req)
        req.status = status
        return req

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            kv_usage=self.kv.usage,
            num_free_blocks=self.kv.pool.num_free_blocks,
            num_blocks=self.kv.pool.num_blocks,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            tenants={t: replace(v) for t, v in self.fair.served.items()},
            strategies_version=self.strategies.version,
        )
