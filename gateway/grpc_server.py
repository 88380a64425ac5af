"""The gateway's public gRPC front: `splitserve.v1.Generate` (server stream).

The same API keys as HTTP (`authorization: Bearer <key>` metadata; UNAUTHENTICATED
without an accepted one when keys are configured) and the same validation
(gateway/protocol.py) before any routing; errors become gRPC status codes
(INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, ...). The caller's
deadline bounds the worker call; a cancelled call cancels the worker stream.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gateway.body import check_request_id
from gateway.core import Gateway
from gateway.errors import APIError, InvalidRequest
from gateway.generation_config import SAMPLING_FIELDS
from gateway.identity import bearer_token, check_labels
from gateway.protocol import (
    COMPLETION_MAX_TOKENS,
    GenerateInput,
    chat_tools,
    finish_input,
    message_text,
)
from gateway.tools import ChatOutput, forced_structure, tools_from_json
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
        tools = None
        if which != "chat" and (req.tools_json or req.tool_choice_json):
            raise InvalidRequest("tools_json and tool_choice_json need chat input", "tools_json")
        if which == "prompt":
            ids = ctx.tokenizer.encode(req.prompt)
        elif which == "chat":
            msgs = [message_text(_chat_message(m), i) for i, m in enumerate(req.chat.messages)]
            if not msgs:
                raise InvalidRequest("chat.messages must be non-empty", "chat")
            tools = chat_tools(ctx, tools_from_json(req.tools_json, req.tool_choice_json))
            try:
                ids = ctx.tokenizer.encode_chat(msgs, tools=list(tools.tools) if tools else None)
            except ValueError as e:
                raise InvalidRequest(str(e), "chat") from e
        elif which == "token_ids":
            ids = list(req.token_ids.ids)
        else:
            raise InvalidRequest("give one of prompt, chat or token_ids", "input")
        params = sampling_from_proto(req.sampling)
        ctx.defaults.apply(params, [k for k in SAMPLING_FIELDS
                                    if not req.sampling.HasField(k)])
        forced = forced_structure(tools)
        if forced is not None:  # tool_choice required / named
            if params.structured is not None:
                raise InvalidRequest("You can only use one kind of structured outputs "
                                     "constraint but multiple are specified: "
                                     "sampling.structured, tool_choice", "tool_choice_json")
            params.structured = forced[1]
        given = req.sampling.HasField("max_tokens")
        if given and params.max_tokens <= 0:
            raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
        if req.echo and params.prompt_logprobs is None:
            # as HTTP: completions echo with logprobs asks for the prompt's too; chat
            # echo always does, top_logprobs of them (0: the chosen ids alone)
            params.prompt_logprobs = (params.logprobs or 0) if which == "chat" \
                else params.logprobs
        salt = req.cache_salt if req.HasField("cache_salt") else None
        text = (req.prompt if which == "prompt" else ctx.tokenizer.decode(ids, False)) \
            if req.echo else ""
        # vLLM's completions default of 16 tokens for prompt / token_ids input; chat
        # gets the rest of the context.
        default_max = None if which == "chat" else COMPLETION_MAX_TOKENS
        return finish_input(ctx, model, ids, params, given, default_max, cache_salt=salt,
                            priority=req.priority, echo=req.echo, prompt_text=text,
                            tools=tools)

    def _identify(self, inp: GenerateInput, req: pb.GenerateRequest,
                  token: str) -> GenerateInput:
        """Tenant and labels (gateway/identity.py): the API key; the request's `tenant`
        when trusted; its `labels` as HTTP's body `metadata`."""
        try:
            labels = check_labels(dict(req.labels), "labels") if req.labels else {}
        except ValueError as e:
            raise InvalidRequest(str(e), "labels") from e
        ident = self.gw.identity.resolve(token, req.tenant or None, metadata=labels)
        inp.tenant, inp.labels = ident.tenant, dict(ident.labels)
        return inp

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        md = dict(context.invocation_metadata() or ())
        rid = request.request_id or str(md.get("x-request-id") or "") or uuid.uuid4().hex
        remaining = context.time_remaining()
        budget = self.gw.config.request_timeout_s
        deadline = time.monotonic() + (min(remaining, budget) if remaining else budget)
        try:
            check_request_id(rid)
            token = bearer_token(md.get("authorization"))
            self.gw.identity.authenticate(token)
            inp = self._identify(await self.gw.ctx.off_loop(self._input, request), request,
                                 token)
            async with contextlib.aclosing(self.gw.stream(inp, rid, deadline)) as stream:
                echoed: set[int] = set()
                texts: dict[int, list[str]] = {}  # per sample, with tools: read at the end
                async for r in stream:
                    # `echo`: the prompt's text leads each sample's first delta.
                    text = r.text if not inp.echo or r.index in echoed \
                        else inp.prompt_text + r.text
                    echoed.add(r.index)
                    out = pb.GenerateResponse(
                        request_id=rid, token_ids=r.token_ids, text=text,
                        finish_reason=r.finish_reason, index=r.index, logprobs=r.logprobs,
                        prompt_logprobs=r.prompt_logprobs,
                        cumulative_logprob=r.cumulative_logprob)
                    if r.HasField("stop_str"):
                        out.stop_str = r.stop_str
                    elif r.HasField("stop_token_id"):
                        out.stop_token_id = r.stop_token_id
                    if inp.tools is not None:
                        texts.setdefault(r.index, []).append(r.text)
                        if r.finish_reason:
                            _tool_calls(out, ChatOutput(inp.tools), "".join(texts[r.index]))
                    if r.finish_reason:
                        out.usage.prompt_tokens = len(inp.prompt_token_ids)
                        out.usage.completion_tokens = r.num_output_tokens
                        out.usage.cached_tokens = r.num_cached_tokens
                    yield out
        except APIError as e:
            log.info("event=grpc_error request_id=%s code=%s message=%r", rid, e.grpc_code.name,
                     e.message)
            await context.abort(e.grpc_code, e.message, trailing_metadata=e.trailing_metadata())


def _chat_message(m: pb.ChatMessage) -> dict[str, Any]:
    """A wire chat message in the OpenAI request's shape (validated by protocol.py)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": c.type or "function", "function": {
            "name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
    return out


def _tool_calls(out: pb.GenerateResponse, chat: ChatOutput, text: str) -> None:
    """A sample's last response: the calls read from its whole text, and the finish
    reason "tool_calls" when the model called (as the HTTP response has them)."""
    _, calls, finish = chat.message(text, out.finish_reason)
    out.finish_reason = finish or out.finish_reason
    out.tool_calls.extend(pb.ToolCall(id=c["id"], type=c["type"], name=c["function"]["name"],
                                      arguments=c["function"]["arguments"]) for c in calls)
