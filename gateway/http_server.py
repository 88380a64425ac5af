"""The OpenAI-compatible HTTP front (aiohttp): /v1/completions, /v1/chat/completions,
/v1/models, /tokenize, /detokenize, /health, /metrics (open, as vLLM leaves them); with
the admin key, /admin/v1/routing, /api/v1/scheduling/strategies and /debug/workers.

Every response carries `x-request-id` (the client's, or a new one); the id goes to the
worker in gRPC metadata and into every log line. A completion or chat request that sends
`x-splitserve-ttft: 1` gets its first token's breakdown back under the same header. Errors use vLLM's JSON shape. A
streamed request waits for its first token before sending headers, so routing errors
(429, 503) still get their status; an error after that is sent as an SSE `error`
event followed by `[DONE]`.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.body import PIECEWISE_BYTES, check_request_id, parse_json
from gateway.choices import Choices, merged_streams
from gateway.core import Gateway
from gateway.errors import APIError, Forbidden, InvalidRequest, Unauthorized
from gateway.identity import bearer_token, header_labels, metadata_labels
from gateway.openai_format import DONE, ResponseBuilder, model_list, sse
from gateway.protocol import (
    GenerateInput,
    ModelContext,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from gateway.routing.profile import RoutingProfile

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
STARTED_KEY: web.AppKey[int] = web.AppKey("started", int)
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
TTFT_HEADER = "x-splitserve-ttft"


def _json_error(e: APIError, rid: str) -> web.Response:
    return web.json_response(e.body(), status=e.status,
                             headers={"x-request-id": rid, **e.headers()})


def _bearer(request: web.Request) -> str:
    return bearer_token(request.headers.get("Authorization"))


@web.middleware
async def _middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    gw = request.app[GATEWAY_KEY]
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex
    request[REQUEST_ID] = rid
    endpoint = request.path
    try:
        try:
            check_request_id(rid)
        except InvalidRequest:
            request[REQUEST_ID] = rid = uuid.uuid4().hex  # the client's cannot be echoed
            raise
        if request.path.startswith("/v1/"):
            gw.identity.authenticate(_bearer(request))
        resp = await handler(request)
    except APIError as e:
        rid = request[REQUEST_ID]  # a body's request_id may have named it
        log.info("event=http_error request_id=%s path=%s status=%d message=%r", rid, endpoint,
                 e.status, e.message)
        gw.metrics.requests.labels(endpoint, str(e.status)).inc()
        return _json_error(e, rid)
    except web.HTTPException as e:  # aiohttp's own (404 route, 405 method, ...)
        err = APIError(e.reason)
        err.status, err.err_type = e.status, "NotFoundError" if e.status == 404 else e.reason
        return _json_error(err, rid)
    gw.metrics.requests.labels(endpoint, str(resp.status)).inc()
    if not resp.prepared:
        resp.headers["x-request-id"] = request[REQUEST_ID]
    return resp


async def _body(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise InvalidRequest(f"the request body is too large (limit "
                             f"{request.app[GATEWAY_KEY].config.client_max_size} bytes)") from e
    if len(raw) >= PIECEWISE_BYTES:  # tens of ms of parsing: off the event loop
        return await request.app[GATEWAY_KEY].ctx.off_loop(parse_json, raw)
    return parse_json(raw)


async def completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY_KEY]
    body = await _body(request)
    rid = _request_id(request, body)
    inps = [_identify(request, inp, body)
            for inp in await gw.ctx.off_loop(parse_completion, body, gw.ctx)]
    return await _generate(request, inps, ResponseBuilder(inps[0].model, chat=False,
                                                          id=f"cmpl-{rid}"))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY_KEY]
    body = await _body(request)
    rid = _request_id(request, body)
    inp = _identify(request, await gw.ctx.off_loop(parse_chat, body, gw.ctx), body)
    return await _generate(request, [inp], ResponseBuilder(inp.model, chat=True,
                                                           id=f"chatcmpl-{rid}"))


def _request_id(request: web.Request, body: Any) -> str:
    """vLLM's request id: the x-request-id header, else the body's `request_id`, else
    a fresh one; the response's `id` is it behind "cmpl-" / "chatcmpl-", as vLLM's."""
    given = body.get("request_id") if isinstance(body, dict) else None
    if given is not None and "x-request-id" not in request.headers:
        if not isinstance(given, str):
            raise InvalidRequest("`request_id` must be a string", "request_id")
        try:
            request[REQUEST_ID] = check_request_id(given)
        except InvalidRequest as e:
            raise InvalidRequest(e.message.replace("(x-request-id)", "(`request_id`)"),
                                 "request_id") from e
    return str(request[REQUEST_ID])


def _identify(request: web.Request, inp: GenerateInput, body: dict[str, Any]) -> GenerateInput:
    """The request's tenant and labels: API key, trusted X-Tenant / X-Labels headers,
    the body's `metadata` (gateway/identity.py)."""
    ident = request.app[GATEWAY_KEY].identity.resolve(
        _bearer(request), request.headers.get("X-Tenant"),
        header_labels(request.headers.get("X-Labels")), metadata_labels(body))
    inp.tenant, inp.labels = ident.tenant, dict(ident.labels)
    return inp


async def _generate(request: web.Request, inps: list[GenerateInput],
                    b: ResponseBuilder) -> web.StreamResponse:
    """One prompt's worker stream, or several (a prompt list) merged; choices numbered
    and shaped by gateway/choices.py."""
    gw = request.app[GATEWAY_KEY]
    rid = request[REQUEST_ID]
    t0 = time.monotonic()
    deadline = t0 + gw.config.request_timeout_s
    inp = inps[0]
    ttft = inp.ttft if wants_ttft(request.headers.get(TTFT_HEADER)) else None
    choices = Choices(inps, b, lambda ids: gw.ctx.tokenizer.decode(ids, False))
    resp: web.StreamResponse | None = None
    gw.metrics.in_flight.inc()
    try:
        async with contextlib.aclosing(merged_streams(gw, inps, rid, deadline)) as stream:
            async for prompt, r in stream:
                if r.finish_reason == "error":
                    raise APIError(f"the worker failed the request: {r.error}")
                delta = choices.add(prompt, r)
                if not inp.stream:
                    continue
                if resp is None:
                    resp = await _open_sse(request, rid, ttft)
                    if b.chat:  # every choice opens with the assistant role
                        for i in range(len(choices.choices)):
                            await resp.write(sse(choices.opening(i)))
                        for echo in choices.echo_chunks():  # then its echo, if asked
                            await resp.write(sse(echo))
                chunk = choices.chunk(delta)
                if chunk is not None:
                    await resp.write(sse(chunk))
    except APIError as e:
        if resp is None:
            raise
        log.warning("event=stream_error request_id=%s message=%r", rid, e.message)
        await resp.write(sse(e.body()))
        await resp.write(DONE)
        return resp
    finally:
        gw.metrics.in_flight.dec()
    gw.metrics.e2e.labels(inp.model).observe(time.monotonic() - t0)
    if not inp.stream:
        return web.json_response(choices.full(),
                                 headers={TTFT_HEADER: ttft_header(ttft)} if ttft else None)
    if resp is None:  # finished without a single response (cannot happen normally)
        resp = await _open_sse(request, rid)
    if inp.include_usage:
        await resp.write(sse(b.usage_chunk(*choices.usage())))
    await resp.write(DONE)
    await resp.write_eof()
    return resp


def wants_ttft(value: str | None) -> bool:
    """Whether a request asked for its first token's breakdown (`x-splitserve-ttft: 1`);
    off by default: the figures are the gateway's internals."""
    if value is None:
        return False
    v = value.strip().lower()
    if v in ("1", "true"):
        return True
    if v in ("0", "false"):
        return False
    raise InvalidRequest(f"{TTFT_HEADER} must be 1 or 0 (true or false), not {value!r}")


def ttft_header(ttft: dict[str, float]) -> str:
    """`x-splitserve-ttft`: where the first token's time went, in Server-Timing syntax
    (milliseconds): `queue;dur=0.1, route;dur=0.4, worker_queue;dur=0.1, prefill;dur=12.3,
    kv_transfer;dur=1.5, total;dur=15.2`. total minus the parts is the network, gRPC and
    the gateway's own work."""
    order = ("queue", "route", "worker_queue", "prefill", "kv_transfer", "total")
    return ", ".join(f"{k};dur={ttft[k] * 1000:.2f}" for k in order if k in ttft)


async def _open_sse(request: web.Request, rid: str,
                    ttft: dict[str, float] | None = None) -> web.StreamResponse:
    headers = {"Content-Type": "text/event-stream; charset=utf-8",
               "Cache-Control": "no-cache", "x-request-id": rid}
    if ttft:  # headers go out with the first token: its breakdown is known
        headers[TTFT_HEADER] = ttft_header(ttft)
    resp = web.StreamResponse(headers=headers)
    await resp.prepare(request)
    return resp


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: {count, max_model_len, tokens, token_strs}."""
    gw = request.app[GATEWAY_KEY]
    body = await _body(request)
    return web.json_response(await gw.ctx.off_loop(_tokenize, body, gw.ctx))


def _tokenize(body: Any, ctx: ModelContext) -> dict[str, Any]:
    ids = parse_tokenize(body, ctx)
    strs = [ctx.tokenizer.id_to_token(t) for t in ids] \
        if isinstance(body, dict) and body.get("return_token_strs") else None
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids,
            "token_strs": strs}


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: {prompt}."""
    gw = request.app[GATEWAY_KEY]
    body = await _body(request)
    return web.json_response(await gw.ctx.off_loop(_detokenize, body, gw.ctx))


def _detokenize(body: Any, ctx: ModelContext) -> dict[str, Any]:
    """Checking and decoding a long id list take ~0.1 s per million ids: off the loop."""
    return {"prompt": ctx.tokenizer.decode(parse_detokenize(body, ctx), False)}


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_KEY]
    return web.json_response(model_list(gw.ctx.served_name, gw.ctx.max_model_len,
                                        request.app[STARTED_KEY]))


async def health(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_KEY]
    return web.Response(status=200 if gw.ready() else 503)


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY_KEY]
    return web.Response(body=generate_latest(gw.metrics.registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def workers(request: web.Request) -> web.Response:
    """Debugging aid: the registry's view (not part of the OpenAI API). It names every
    worker's internal address and state, so it is an admin route."""
    _check_admin(request)
    return web.json_response(request.app[GATEWAY_KEY].registry.snapshot())


def _check_admin(request: web.Request) -> None:
    """401 without a Bearer key, 403 with a wrong one or when no admin key is set."""
    key = request.app[GATEWAY_KEY].config.admin_key
    token = _bearer(request)
    if not token:
        raise Unauthorized("the admin API needs `Authorization: Bearer <admin key>`")
    if key is None:
        raise Forbidden("the admin API is disabled (start the gateway with --admin-key)")
    if not hmac.compare_digest(token.encode(), key.encode()):
        raise Forbidden("wrong admin key")


async def get_routing(request: web.Request) -> web.Response:
    """The live routing profile (as `POST` takes it)."""
    _check_admin(request)
    return web.json_response(request.app[GATEWAY_KEY].router.profile.to_dict())


async def post_routing(request: web.Request) -> web.Response:
    """Replaces the routing profile: a body in YAML or JSON (the same mapping as the
    `--routing` file, `routing:` key optional), validated whole before the swap."""
    import yaml

    _check_admin(request)
    gw = request.app[GATEWAY_KEY]
    raw = await request.read()
    try:
        data = yaml.safe_load(raw.decode())
        if isinstance(data, dict) and isinstance(data.get("routing"), dict):
            data = data["routing"]
        if not isinstance(data, dict):
            raise ValueError("a routing profile is a mapping")
        profile = RoutingProfile.from_dict(data)
    except RecursionError:
        raise InvalidRequest("invalid routing profile: nested too deeply") from None
    except (ValueError, TypeError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise InvalidRequest(f"invalid routing profile: {e}") from e
    gw.set_profile(profile)
    return web.json_response(profile.to_dict())


async def get_strategies(request: web.Request) -> web.Response:
    """The scheduling strategies in force: `{"version": N, "scheduling": [...]}`."""
    _check_admin(request)
    return web.json_response(request.app[GATEWAY_KEY].strategies.current.to_dict())


async def post_strategies(request: web.Request) -> web.Response:
    """Replaces the scheduling strategies (engine/strategies.py has the shape): 400 with
    the reason when invalid; stored with the next version (Redis), which the gateway's
    admission queue applies now and the workers within their poll interval."""
    _check_admin(request)
    stored = await request.app[GATEWAY_KEY].strategies.replace(await _body(request))
    return web.json_response(stored.to_dict())


def build_app(gw: Gateway) -> web.Application:
    app = web.Application(client_max_size=gw.config.client_max_size,
                          middlewares=[_middleware])
    app[GATEWAY_KEY] = gw
    app[STARTED_KEY] = int(time.time())
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/debug/workers", workers)
    app.router.add_get("/admin/v1/routing", get_routing)
    app.router.add_post("/admin/v1/routing", post_routing)
    app.router.add_get("/api/v1/scheduling/strategies", get_strategies)
    app.router.add_post("/api/v1/scheduling/strategies", post_strategies)
    return app
