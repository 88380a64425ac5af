"""Continuous-batching scheduler (vLLM v1's model).

Each step hands out a token budget: running requests first (one token each when
decoding, a chunk when still prefilling), then waiting requests, whose prompts are
chunked to fit. When blocks run out, the least-progressed running request is
preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.block_pool import KVBlock
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.offload import OffloadConnector
from engine.request import Request, RequestStatus


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


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 offload: OffloadConnector | None = None) -> None:
        self.config = config
        self.kv = kv
        self.offload = offload  # external KV tiers (host, disk, ...), if any
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # finished producers whose KV is being sent
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.running or any(r.status != RequestStatus.WAITING_FOR_REMOTE_KV
                                        for r in self.waiting))

    def _order_key(self, r: Request) -> tuple[float, float]:
        prio = float(r.priority) if self.config.policy == "priority" else 0.0
        return (prio, r.arrival_time)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self._pick_victim(self.running[i:])
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n))
                budget -= n
                i += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        self.waiting.sort(key=self._order_key)
        admitted = []
        for req in self.waiting:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                continue
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
                break
            n = min(n, budget)
            if not self.kv.allocate_slots(req, n + ext * self.kv.block_size, blocks):
                break  # head-of-line: keep order, wait for blocks
            if ext:
                self._plan_load(req, len(blocks), ext)
                num_hit += ext * self.kv.block_size
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        for req in admitted:
            self.waiting.remove(req)

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
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return True

    def remote_kv_ready(self, req: Request, first_token: int | None,
                        num_computed_tokens: int | None = None) -> None:
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
            req.append_token(first_token)
        elif num_computed_tokens is not None and num_computed_tokens > req.num_computed_tokens:
            if num_computed_tokens % self.kv.block_size or num_computed_tokens >= req.num_tokens:
                raise RuntimeError(f"bad remote KV extent {num_computed_tokens} for "
                                   f"{req.request_id} ({req.num_tokens} tokens)")
            # | local hit | pulled from a peer | computed here |
            req.num_computed_tokens = req.num_cached_tokens = num_computed_tokens
            self.kv.cache_blocks(req, num_computed_tokens)
        req.status = RequestStatus.WAITING

    def release(self, request_id: str) -> bool:
        """Frees a finished producer's held blocks. False if none are held."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(req)
        return True

    def _pick_victim(self, candidates: list[Request]) -> Request:
        # Least progressed loses the least work; under the priority policy the lowest
        # priority (largest value) goes first, latest arrival breaking ties.
        def badness(r: Request) -> tuple[float, int, float]:
            prio = float(r.priority) if self.config.policy == "priority" else 0.0
            return (prio, -r.num_computed_tokens, r.arrival_time)
        return max(candidates, key=badness)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)

    def update_from_output(self, out: SchedulerOutput,
                           sampled: Mapping[str, tuple[int, Any]]) -> list[Request]:
        """Advances computed tokens, appends sampled tokens, caches full blocks.

        Returns the requests that received a new token this step.
        """
        got_token = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_blocks(req, req.num_computed_tokens)
            got = sampled.get(req.request_id)
            if got is not None:
                req.append_token(got[0])
                if got[1] is not None:
                    req.logprobs.append(got[1])
                got_token.append(req)
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
        )
