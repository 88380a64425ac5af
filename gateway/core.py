"""The request path shared by the HTTP and gRPC fronts: admit, route, stream.

`Gateway.stream(inp, request_id, deadline)` waits for admission (gateway/admission.py:
room on a worker, fair order across tenants, a bounded queue) and yields the chosen
worker's responses.
It owns the worker call: when the caller stops iterating (client gone, deadline) the
gRPC stream to the worker is cancelled, which makes the worker abort the request and
free its blocks. A worker that fails before its first token is marked failed and the
request is retried on another (up to `max_route_attempts`). One that fails mid-stream
(dies, is cut at the end of its drain, or ends without a finish reason) is marked
failed and the request resumes on another worker with the tokens already streamed
(`resume_token_ids`; up to `max_failovers`, within the deadline): greedy output is
token-identical to an uninterrupted run and text deltas join seamlessly. Requests with
n > 1 or best_of end with a clean error instead.

A frozen worker (alive, not answering: SIGSTOP, a paused container, a stuck device)
breaks no connection, so a watchdog stands in for the error: while a call waits, the
decode worker's load reports (and, before the first token, the prefill worker's) must
keep arriving; one silent for `load_stale_s` ends the call as an unavailable worker
would (retried or resumed elsewhere), and routing leaves it until it reports again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import grpc

from engine.block_hash import hash_blocks, make_extra_key
from engine.strategies import StrategySet
from gateway.admission import AdmissionQueue, WorkerSlots
from gateway.config import GatewayConfig, in_flight_limit
from gateway.errors import (
    APIError,
    InvalidRequest,
    NoWorkerAvailable,
    Overloaded,
    UpstreamTimeout,
)
from gateway.identity import IdentityResolver
from gateway.locality import Locality
from gateway.metrics import GatewayMetrics
from gateway.protocol import GenerateInput, ModelContext
from gateway.registry import WorkerEntry, WorkerRegistry
from gateway.routing.base import RouteDecision, RouteRequest
from gateway.routing.profile import NoCandidates, Router, RoutingProfile
from gateway.scheduling import StrategyStore
from kvtransfer.index import IndexConfig, IndexLookup, RedisBlockIndex
from protos import splitserve_pb2 as pb
from protos.convert import sampling_to_proto

log = logging.getLogger(__name__)


class Gateway:
    def __init__(self, config: GatewayConfig, ctx: ModelContext, registry: WorkerRegistry,
                 metrics: GatewayMetrics, block_size: int = 16) -> None:
        self.config = config
        self.ctx = ctx
        self.registry = registry
        self.metrics = metrics
        self.router = Router(config.routing)  # replaced whole by set_profile
        self.block_size = block_size
        self.in_flight = 0
        index = RedisBlockIndex(config.redis_url, config.served_model_name, IndexConfig(
            timeout_ms=config.index_timeout_ms,
            breaker_failures=config.index_breaker_failures,
            breaker_cooldown_s=config.index_breaker_cooldown_s)) if config.redis_url else None
        self.locality = Locality(index, metrics, config.locality_alpha,
                                 config.locality_min_trust)
        self.identity = IdentityResolver(config.api_keys, config.tenant_keys,
                                         config.default_tenant, config.trust_client_identity)
        self.slots = WorkerSlots(registry, config.max_waiting_per_worker, config.kv_headroom)
        self.admission = AdmissionQueue(self.slots, config.admission_queue_size,
                                        fair=config.admission_order == "vtc", metrics=metrics)
        metrics.watch_pool(config.served_model_name, registry.candidates,
                           self.admission.waiting)
        self.strategies = StrategyStore(config.redis_url, config.served_model_name,
                                        config.redis_timeout_s, config.strategies_poll_s,
                                        self._apply_strategies)

    async def start(self) -> None:
        """Reads the stored scheduling strategies and starts following them."""
        await self.strategies.start()

    def _apply_strategies(self, strategies: StrategySet) -> None:
        self.admission.set_strategies(strategies)
        self.metrics.strategies_version.set(strategies.version)

    def set_profile(self, profile: RoutingProfile) -> None:
        """Swaps the routing profile atomically: requests routed after this call use the
        new one; a request being routed keeps the router it started with."""
        self.router = Router(profile)
        log.info("event=routing_profile_set profile=%s", profile.to_dict())

    async def close(self) -> None:
        await self.strategies.close()
        await self.admission.close()
        await self.locality.close()

    def observe_info(self, info: pb.InfoResponse) -> None:
        """A worker's Info: validate against its context limit, hash with its block
        size (all workers of a model share one block size)."""
        self.ctx.observe_worker_limit(info.max_model_len)
        if info.block_size > 0 and info.block_size != self.block_size:
            log.info("block size %d from worker %s (was %d)", info.block_size,
                     info.worker_id, self.block_size)
            self.block_size = info.block_size

    def ready(self) -> bool:
        return any(c.role in ("decode", "colocated") for c in self.registry.candidates())

    async def _route_request(self, inp: GenerateInput, request_id: str,
                             ) -> tuple[RouteRequest, IndexLookup | None]:
        """The prompt's block hashes (salted per tenant) and what the index knows of
        them, for the live workers."""
        hashes = hash_blocks(inp.prompt_token_ids, self.block_size,
                             make_extra_key(inp.model, inp.cache_salt))
        req = RouteRequest(request_id, inp.prompt_token_ids, hashes, self.block_size)
        nodes = {c.worker_id for c in self.registry.candidates()}
        lookup = await self.locality.lookup(hashes, nodes)
        return self.locality.fill(req, lookup), lookup

    def _route(self, req: RouteRequest, lookup: IndexLookup | None,
               model: str) -> RouteDecision:
        try:
            decision = self.router.route(req, self.slots.eligible(self.registry.candidates()))
        except NoCandidates as e:
            raise NoWorkerAvailable(f"no ready worker for model {model!r}: {e}") from e
        self.metrics.routed.labels(decision.decode.worker_id,
                                   "remote" if decision.prefill else "local").inc()
        if lookup is None and self.locality.index is not None:
            reason = "index_unavailable"
        elif decision.kv_peer is not None:
            reason = "peer_fetch"
        elif req.cached_tokens(decision.decode.worker_id) > 0:
            reason = "prefix_hit"
        else:
            reason = "load"
        self.metrics.decision_reasons.labels(reason).inc()
        return decision

    def _worker_request(self, inp: GenerateInput, request_id: str, decision: RouteDecision,
                        resume: list[int]) -> pb.WorkerGenerateRequest:
        # The client's id may repeat (x-request-id reused across requests); the engine
        # needs a unique one, which still starts with the client's id for log searches.
        req = pb.WorkerGenerateRequest(
            request_id=f"{request_id}-{uuid.uuid4().hex[:8]}",
            prompt_token_ids=inp.prompt_token_ids,
            sampling=sampling_to_proto(inp.params), priority=inp.priority,
            tenant=inp.tenant, labels=inp.labels, client_request_id=request_id)
        if inp.cache_salt is not None:
            req.cache_salt = inp.cache_salt
        # Fail-over: the worker continues after the tokens the client already has. A
        # prefill peer would sample a first token, which the request already has.
        req.resume_token_ids.extend(resume)
        if decision.prefill is not None and not resume:
            req.prefill_peer.address = decision.prefill.address
            req.prefill_peer.worker_id = decision.prefill.worker_id
        if decision.kv_peer is not None:
            req.kv_peer.address = decision.kv_peer.address
            req.kv_peer.worker_id = decision.kv_peer.worker_id
            req.kv_peer.num_blocks = decision.kv_peer_blocks
        return req

    def in_flight_limit(self) -> int:
        """Requests this gateway serves at once (more get 429): --max-in-flight, or by
        default grown with the decode/colocated workers it knows."""
        return in_flight_limit(self.config.max_in_flight, self.registry.serving_workers())

    async def stream(self, inp: GenerateInput, request_id: str, deadline: float,
                     ) -> AsyncGenerator[pb.WorkerGenerateResponse, None]:
        """Admission first (gateway/admission.py: waits for room on a worker, in fair
        order across tenants), then the routed worker stream; accounts the request's
        service to its tenant. Raises an APIError before the first response on overload
        (429, with retry_after), no worker, bad request (as the worker judged it) or
        timeout."""
        t0, model, tenant = time.monotonic(), inp.model, inp.tenant
        limit = self.in_flight_limit()
        if self.in_flight >= limit:
            self.metrics.rejected.labels("overload", tenant).inc()
            raise Overloaded(f"the gateway is at its limit of {limit} requests in flight; "
                             "retry later", retry_after=1)
        if not await self._wait_ready(deadline):
            raise NoWorkerAvailable(f"no ready worker for model {model!r}")
        try:
            ticket = await self.admission.admit(tenant, inp.labels, request_id, inp.priority,
                                                len(inp.prompt_token_ids), deadline)
        except Overloaded:
            self.metrics.rejected.labels("admission_queue_full", tenant).inc()
            raise
        self.metrics.queue_time.labels(model, tenant).observe(ticket.queue_s)
        inp.ttft["queue"] = ticket.queue_s
        self.metrics.prompt_tokens.labels(model, tenant).inc(len(inp.prompt_token_ids))
        first = True
        try:
            async with contextlib.aclosing(self._stream(inp, request_id, deadline)) as out:
                async for resp in out:
                    if first and resp.token_ids:
                        first = False
                        inp.ttft["total"] = time.monotonic() - t0
                        self.metrics.ttft.labels(model, tenant).observe(inp.ttft["total"])
                        if resp.HasField("first_token_timings"):
                            w = resp.first_token_timings
                            inp.ttft |= {"worker_queue": w.worker_queue_s,
                                         "prefill": w.prefill_s,
                                         "kv_transfer": w.kv_transfer_s}
                        self.metrics.observe_ttft_parts(model, inp.ttft)
                    ticket.charge(resp.num_output_tokens)
                    yield resp
        finally:
            ticket.release()
            self.metrics.generation_tokens.labels(model, tenant).inc(ticket.output_tokens)

    async def _wait_ready(self, deadline: float) -> bool:
        """True once a serving worker is routable. A worker taken out of routing by one
        broken call (mark_failed) reconnects within moments: waits for it, at most
        `failover_wait_s` and never past the deadline; with no such worker, fails now."""
        limit = min(deadline, time.monotonic() + self.config.failover_wait_s)
        while not self.ready():
            if time.monotonic() >= limit \
                    or not self.registry.recently_routable(self.config.failover_wait_s):
                return False
            await asyncio.sleep(0.05)
        return True

    async def _stream(self, inp: GenerateInput, request_id: str, deadline: float,
                      ) -> AsyncGenerator[pb.WorkerGenerateResponse, None]:
        """The routed worker stream, retried on another worker when one fails before
        its first token, and resumed on another (fail-over) when one fails after it:
        the new worker continues after the tokens already streamed, so the caller sees
        one uninterrupted stream (see _after_failure)."""
        self.in_flight += 1
        t0 = time.monotonic()
        try:
            req, lookup = await self._route_request(inp, request_id)
            run = _Run(samples=_many_samples(inp))
            ended = 0  # samples finished (n > 1: finish_reason ends one sample each)
            while True:
                decision = await self._route_run(req, lookup, inp.model, run, deadline)
                inp.ttft.setdefault("route", time.monotonic() - t0)  # the first decision
                try:
                    # aclosing: when our caller stops early, the worker call is cancelled
                    # now, not whenever the garbage collector finalizes the generator.
                    async with contextlib.aclosing(self._call(
                            inp, request_id, decision, deadline, run.streamed)) as responses:
                        async for resp in responses:
                            if not run.started and lookup is not None:
                                wid = decision.decode.worker_id
                                self.locality.observe(wid, decision.predicted_cached(req),
                                                      resp.num_cached_tokens)
                            run.observe(resp)
                            yield resp
                            ended += bool(resp.finish_reason)
                            if ended == inp.params.n:
                                return
                    failure: grpc.aio.AioRpcError | WorkerStalled | None = None  # no finish
                except (grpc.aio.AioRpcError, WorkerStalled) as e:
                    failure = e
                self._after_failure(run, failure, request_id, decision)
        finally:
            self.in_flight -= 1

    async def _route_run(self, req: RouteRequest, lookup: IndexLookup | None, model: str,
                         run: _Run, deadline: float) -> RouteDecision:
        """A worker for the next attempt. Retrying or resuming, it waits (until the
        deadline, at most `failover_wait_s`) for one to become routable: the worker that
        just failed may be the only one, back as soon as its load stream reconnects."""
        limit = min(deadline, time.monotonic() + self.config.failover_wait_s)
        while True:
            try:
                return self._route(req, lookup, model)
            except NoWorkerAvailable:
                left = limit - time.monotonic()
                if not (run.started or run.route_failures) or left <= 0:
                    raise
                await asyncio.sleep(min(left, 0.1))

    def _after_failure(self, run: _Run, error: grpc.aio.AioRpcError | WorkerStalled | None,
                       request_id: str, decision: RouteDecision) -> None:
        """A worker call broke (`error`; None: its stream ended without a finish
        reason). Returns when the request goes on on another worker (retried before its
        first token, resumed after it), else raises the client's clean error."""
        address = decision.decode.address
        if isinstance(error, WorkerStalled):  # frozen: as good as unavailable
            code: grpc.StatusCode | None = grpc.StatusCode.UNAVAILABLE
            address = error.address
        else:
            code = error.code() if error is not None else None
        if not run.started:  # nothing streamed: only an unavailable worker is retried
            run.route_failures += 1
            if (code is not None and code != grpc.StatusCode.UNAVAILABLE) \
                    or run.route_failures >= self.config.max_route_attempts:
                raise _api_error(error) if error is not None else \
                    APIError("the worker ended the stream without a result")
            log.warning("event=retry request_id=%s worker=%s "
                        "reason=unavailable_before_first_token", request_id, address)
            self.registry.mark_failed(address)
            return
        if code is not None and code not in RESUMABLE:
            raise _api_error(error)  # type: ignore[arg-type]
        reason = code.name if code is not None else "no_finish_reason"
        if run.samples:
            self.metrics.failovers.labels("refused_n").inc()
            raise APIError(f"the worker serving this request failed mid-stream ({reason}); "
                           "requests with n > 1 or best_of cannot be resumed elsewhere")
        if run.failovers >= self.config.max_failovers:
            self.metrics.failovers.labels("exhausted").inc()
            raise NoWorkerAvailable(f"the request's workers failed {run.failovers + 1} times "
                                    f"mid-stream (last: {reason})")
        run.failovers += 1
        self.metrics.failovers.labels("resumed").inc()
        log.warning("event=failover request_id=%s worker=%s reason=%s resume_tokens=%d",
                    request_id, address, reason, len(run.streamed))
        self.registry.mark_failed(address)

    async def _call(self, inp: GenerateInput, request_id: str, decision: RouteDecision,
                    deadline: float, resume: list[int],
                    ) -> AsyncGenerator[pb.WorkerGenerateResponse, None]:
        entry = self.registry.entry(decision.decode.address)
        if entry is None:
            raise NoWorkerAvailable("the chosen worker left the registry")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise UpstreamTimeout("the request's deadline passed before it was routed")
        log.info("event=route request_id=%s worker=%s address=%s prefill=%s kv_peer=%s "
                 "prompt_tokens=%d resume_tokens=%d", request_id, decision.decode.worker_id,
                 decision.decode.address, decision.prefill.worker_id if decision.prefill else "-",
                 decision.kv_peer.worker_id if decision.kv_peer else "-",
                 len(inp.prompt_token_ids), len(resume))
        call = entry.stub.Generate(self._worker_request(inp, request_id, decision, resume),
                                   timeout=remaining,
                                   metadata=(("x-request-id", request_id),))
        prefill = self.registry.entry(decision.prefill.address) \
            if decision.prefill is not None and not resume else None
        watch = _Watchdog(call, entry, prefill, self.config.load_stale_s)
        entry.inflight += 1
        done = False
        try:
            try:
                async for resp in call:
                    watch.first_token = True
                    done = bool(resp.finish_reason)
                    yield resp
            except (asyncio.CancelledError, grpc.aio.AioRpcError):
                if watch.stalled is None:
                    raise
            if watch.stalled is not None:  # the watchdog cancelled the call
                log.warning("event=worker_stalled request_id=%s worker=%s stale_s=%.1f",
                            request_id, watch.stalled, self.config.load_stale_s)
                raise WorkerStalled(watch.stalled)
        finally:
            watch.close()
            entry.inflight -= 1
            if not done:
                log.info("event=caller_left request_id=%s action=cancel_worker_call", request_id)
            call.cancel()  # no-op when finished; frees the worker's blocks otherwise


class WorkerStalled(Exception):
    """A worker in the call sent no load report for `load_stale_s`: frozen."""

    def __init__(self, address: str) -> None:
        super().__init__(f"worker {address} stopped answering")
        self.address = address


class _Watchdog:
    """Cancels `call` when its decode worker (or, until the first token, its prefill
    worker) has not reported load for `stale_s`; `stalled` then names that worker. Owns
    one task, ended by `close()`."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, decode: WorkerEntry,
                 prefill: WorkerEntry | None, stale_s: float) -> None:
        self.call, self.decode, self.prefill, self.stale_s = call, decode, prefill, stale_s
        self.first_token = False
        self.stalled: str | None = None
        self._task = asyncio.create_task(self._run())

    def _silent(self, now: float) -> str | None:
        for w in (self.decode, None if self.first_token else self.prefill):
            if w is not None and w.last_report and now - w.last_report >= self.stale_s:
                return w.address
        return None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(min(0.25, self.stale_s / 4))
            stalled = self._silent(time.monotonic())
            if stalled is not None:
                self.stalled = stalled
                self.call.cancel()
                return

    def close(self) -> None:
        self._task.cancel()


# A worker call that broke with one of these after streaming began is resumed elsewhere
# (the worker died, was cut at the end of its drain, or failed inside).
RESUMABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)


@dataclass(slots=True)
class _Run:
    """One request's progress across the workers that serve it (fail-over)."""

    samples: bool = False  # n > 1 / best_of: several samples, one resume list cannot say
    started: bool = False  # the client has seen a response
    streamed: list[int] = field(default_factory=list)  # output tokens the client has
    cached_tokens: int = 0  # the first worker's prefix hit, kept in later responses
    route_failures: int = 0  # before the first response
    failovers: int = 0

    def observe(self, resp: pb.WorkerGenerateResponse) -> None:
        if self.started:
            resp.num_cached_tokens = self.cached_tokens
        else:
            self.started, self.cached_tokens = True, resp.num_cached_tokens
        self.streamed += resp.token_ids


def _many_samples(inp: GenerateInput) -> bool:
    s = sampling_to_proto(inp.params)
    return s.n > 1 or (s.HasField("best_of") and s.best_of > 1)


def _api_error(e: grpc.aio.AioRpcError | WorkerStalled) -> APIError:
    if isinstance(e, WorkerStalled):
        return NoWorkerAvailable(f"worker unavailable: {e}")
    code, msg = e.code(), e.details() or e.code().name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(msg)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return UpstreamTimeout(f"the request timed out: {msg}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(msg)
    if code == grpc.StatusCode.UNAVAILABLE:
        return NoWorkerAvailable(f"worker unavailable: {msg}")
    return APIError(f"worker error ({code.name}): {msg}")
