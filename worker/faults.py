"""Seeded faults on a worker's RPCs (testing; kvtransfer/faults.py has the spec): a
server interceptor that drops, delays or duplicates Generate, Prefill and FetchKV
calls, and SIGKILLs the worker as a Generate stream reaches a chosen output token.
Installed only when a fault spec is given."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from kvtransfer.faults import Faults, FaultSpec

log = logging.getLogger(__name__)

FAULTY_METHODS = ("/splitserve.v1.Worker/Generate", "/splitserve.v1.Prefill/Prefill",
                  "/splitserve.v1.Worker/FetchKV")


class _LateContext:
    """The context of a duplicate call that arrives after the original answered: it has
    the original's metadata and a short deadline; its answer goes nowhere."""

    def __init__(self, original: grpc.aio.ServicerContext, deadline_s: float) -> None:
        self._metadata = original.invocation_metadata()
        self._deadline = asyncio.get_running_loop().time() + deadline_s

    def invocation_metadata(self) -> Any:
        return self._metadata

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - asyncio.get_running_loop().time())

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise RuntimeError(f"duplicate call aborted: {code.name} {details}")


class RpcFaults(grpc.aio.ServerInterceptor):
    def __init__(self, spec: FaultSpec, registry: CollectorRegistry | None = None) -> None:
        self.faults = Faults(spec, "rpc", registry)
        self._late: set[asyncio.Task[Any]] = set()

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method not in FAULTY_METHODS:
            return handler
        kind = self.faults.draw(("drop", "delay", "duplicate"))
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, kind),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            self._unary(handler.unary_unary, kind),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    def _stream(self, behavior: Any, kind: str | None) -> Any:
        faults, delay = self.faults, self.faults.spec.delay_s
        kill_at = faults.spec.kill_token

        async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if kind == "drop":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fault injected: dropped")
            n_out = len(getattr(request, "resume_token_ids", ()))
            async for resp in behavior(request, context):
                n_new = n_out + len(getattr(resp, "token_ids", ()))
                if kill_at is not None and n_out < kill_at <= n_new:
                    faults.kill(f"output token {kill_at} of {request.request_id}")
                n_out = n_new
                if kind == "delay":
                    await asyncio.sleep(delay)
                yield resp
        return run

    def _unary(self, behavior: Any, kind: str | None) -> Any:
        delay = self.faults.spec.delay_s

        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if kind == "drop":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fault injected: dropped")
            if kind == "delay":
                await asyncio.sleep(delay)
            resp = await behavior(request, context)
            if kind == "duplicate":
                task = asyncio.create_task(self._replay(behavior, request, context))
                self._late.add(task)
                task.add_done_callback(self._late.discard)
            return resp
        return run

    async def _replay(self, behavior: Any, request: Any,
                      context: grpc.aio.ServicerContext) -> None:
        await asyncio.sleep(self.faults.spec.delay_s)
        try:
            await behavior(request, _LateContext(context, 5.0))
        except Exception as e:  # the duplicate's outcome goes nowhere; its effects count
            log.info("event=fault_duplicate_done request_id=%s outcome=%r",
                     getattr(request, "request_id", "?"), e)
