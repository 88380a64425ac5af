"""The request path shared by the HTTP and gRPC fronts: admit, route, stream.

`Gateway.stream(inp, request_id, deadline)` yields the chosen worker's responses.
It owns the worker call: when the caller stops iterating (client gone, deadline) the
gRPC stream to the worker is cancelled, which makes the worker abort the request and
free its blocks. A worker that fails before its first token is marked failed and the
request is retried on another (up to `max_route_attempts`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator

import grpc

from engine.block_hash import hash_blocks, make_extra_key
from gateway.config import GatewayConfig
from gateway.errors import (
    APIError,
    InvalidRequest,
    NoWorkerAvailable,
    Overloaded,
    UpstreamTimeout,
)
from gateway.locality import Locality
from gateway.metrics import GatewayMetrics
from gateway.protocol import GenerateInput, ModelContext
from gateway.registry import WorkerRegistry
from gateway.routing.base import RouteDecision, RouteRequest
from gateway.routing.profile import NoCandidates, Router, RoutingProfile
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

    def set_profile(self, profile: RoutingProfile) -> None:
        """Swaps the routing profile atomically: requests routed after this call use the
        new one; a request being routed keeps the router it started with."""
        self.router = Router(profile)
        log.info("event=routing_profile_set profile=%s", profile.to_dict())

    async def close(self) -> None:
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
            decision = self.router.route(req, self.registry.candidates())
        except NoCandidates as e:
            raise NoWorkerAvailable(f"no ready worker for model {model!r}: {e}") from e
        self.metrics.routed.labels(decision.decode.worker_id,
                                   "remote" if decision.prefill else "local").inc()
        if lookup is None and self.locality.index is not None:
            reason = "index_unavailable"
        elif decision.kv_peer is not None:
            reason = "peer_fetch"
        elif req.cached_tokens.get(decision.decode.worker_id, 0) > 0:
            reason = "prefix_hit"
        else:
            reason = "load"
        self.metrics.decision_reasons.labels(reason).inc()
        return decision

    def _worker_request(self, inp: GenerateInput, request_id: str,
                        decision: RouteDecision) -> pb.WorkerGenerateRequest:
        # The client's id may repeat (x-request-id reused across requests); the engine
        # needs a unique one, which still starts with the client's id for log searches.
        req = pb.WorkerGenerateRequest(
            request_id=f"{request_id}-{uuid.uuid4().hex[:8]}",
            prompt_token_ids=inp.prompt_token_ids,
            sampling=sampling_to_proto(inp.params), priority=inp.priority)
        if inp.cache_salt is not None:
            req.cache_salt = inp.cache_salt
        if decision.prefill is not None:
            req.prefill_peer.address = decision.prefill.address
            req.prefill_peer.worker_id = decision.prefill.worker_id
        if decision.kv_peer is not None:
            req.kv_peer.address = decision.kv_peer.address
            req.kv_peer.worker_id = decision.kv_peer.worker_id
            req.kv_peer.num_blocks = decision.kv_peer_blocks
        return req

    async def stream(self, inp: GenerateInput, request_id: str, deadline: float,
                     ) -> AsyncGenerator[pb.WorkerGenerateResponse, None]:
        """Raises an APIError before the first response on overload, no worker, bad
        request (as the worker judged it) or timeout."""
        if self.in_flight >= self.config.max_in_flight:
            self.metrics.rejected.labels("overload").inc()
            raise Overloaded(f"the gateway is at its limit of {self.config.max_in_flight} "
                             "requests in flight; retry later")
        self.in_flight += 1
        try:
            req, lookup = await self._route_request(inp, request_id)
            for attempt in range(1, self.config.max_route_attempts + 1):
                decision = self._route(req, lookup, inp.model)
                sent = False
                try:
                    # aclosing: when our caller stops early, the worker call is cancelled
                    # now, not whenever the garbage collector finalizes the generator.
                    async with contextlib.aclosing(
                            self._call(inp, request_id, decision, deadline)) as responses:
                        async for resp in responses:
                            if not sent and lookup is not None:
                                wid = decision.decode.worker_id
                                self.locality.observe(wid, decision.predicted_cached(req),
                                                      resp.num_cached_tokens)
                            sent = True
                            yield resp
                    return
                except grpc.aio.AioRpcError as e:
                    if sent or e.code() != grpc.StatusCode.UNAVAILABLE \
                            or attempt == self.config.max_route_attempts:
                        raise _api_error(e) from e
                    log.warning("event=retry request_id=%s worker=%s "
                                "reason=unavailable_before_first_token",
                                request_id, decision.decode.address)
                    self.registry.mark_failed(decision.decode.address)
        finally:
            self.in_flight -= 1

    async def _call(self, inp: GenerateInput, request_id: str, decision: RouteDecision,
                    deadline: float) -> AsyncGenerator[pb.WorkerGenerateResponse, None]:
        entry = self.registry.entry(decision.decode.address)
        if entry is None:
            raise NoWorkerAvailable("the chosen worker left the registry")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise UpstreamTimeout("the request's deadline passed before it was routed")
        log.info("event=route request_id=%s worker=%s address=%s prefill=%s kv_peer=%s "
                 "prompt_tokens=%d", request_id, decision.decode.worker_id,
                 decision.decode.address, decision.prefill.worker_id if decision.prefill else "-",
                 decision.kv_peer.worker_id if decision.kv_peer else "-",
                 len(inp.prompt_token_ids))
        call = entry.stub.Generate(self._worker_request(inp, request_id, decision),
                                   timeout=remaining,
                                   metadata=(("x-request-id", request_id),))
        entry.inflight += 1
        done = False
        try:
            async for resp in call:
                done = bool(resp.finish_reason)
                yield resp
        finally:
            entry.inflight -= 1
            if not done:
                log.info("event=caller_left request_id=%s action=cancel_worker_call", request_id)
            call.cancel()  # no-op when finished; frees the worker's blocks otherwise


def _api_error(e: grpc.aio.AioRpcError) -> APIError:
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
