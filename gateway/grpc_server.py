"""The gateway's public gRPC front: `splitserve.v1.Generate` (server stream).

Same validation as HTTP (gateway/protocol.py) before any routing; errors become gRPC
status codes (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, ...). The
caller's deadline bounds the worker call; a cancelled call cancels the worker stream.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from gateway.core import Gateway
from gateway.errors import APIError, InvalidRequest
from gateway.protocol import GenerateInput, finish_input
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from protos.convert import sampling_from_proto

log = logging.getLogger(__name__)


class GenerateService(pb_grpc.GenerateServicer):
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def _input(self, req: pb.GenerateRequest) -> GenerateInput:
        ctx = self.gw.ctx
        model = ctx.check_model(req.model)
        which = req.WhichOneof("input")
        if which == "prompt":
            ids = ctx.tokenizer.encode(req.prompt)
        elif which == "chat":
            msgs = [{"role": m.role, "content": m.content} for m in req.chat.messages]
            if not msgs:
                raise InvalidRequest("chat.messages must be non-empty", "chat")
            try:
                ids = ctx.tokenizer.encode_chat(msgs)
            except ValueError as e:
                raise InvalidRequest(str(e), "chat") from e
        elif which == "token_ids":
            ids = list(req.token_ids.ids)
        else:
            raise InvalidRequest("give one of prompt, chat or token_ids", "input")
        params = sampling_from_proto(req.sampling)
        given = req.sampling.HasField("max_tokens")
        if given and params.max_tokens <= 0:
            raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
        salt = req.cache_salt if req.HasField("cache_salt") else None
        return finish_input(ctx, model, ids, params, given, cache_salt=salt,
                            priority=req.priority)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        md = dict(context.invocation_metadata() or ())
        rid = request.request_id or str(md.get("x-request-id") or "") or uuid.uuid4().hex
        remaining = context.time_remaining()
        budget = self.gw.config.request_timeout_s
        deadline = time.monotonic() + (min(remaining, budget) if remaining else budget)
        try:
            inp = self._input(request)
            async with contextlib.aclosing(self.gw.stream(inp, rid, deadline)) as stream:
                async for r in stream:
                    out = pb.GenerateResponse(request_id=rid, token_ids=r.token_ids,
                                              text=r.text, finish_reason=r.finish_reason)
                    if r.finish_reason:
                        out.usage.prompt_tokens = len(inp.prompt_token_ids)
                        out.usage.completion_tokens = r.num_output_tokens
                        out.usage.cached_tokens = r.num_cached_tokens
                    yield out
        except APIError as e:
            log.info("event=grpc_error request_id=%s code=%s message=%r", rid, e.grpc_code.name,
                     e.message)
            await context.abort(e.grpc_code, e.message)
