"""The HTTP front without workers: API keys, overload (429), no worker (503), request
ids and unknown routes, tokenization off the event loop, through aiohttp's test server
on loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.core import Gateway
from gateway.http_server import build_app
from tests.factories import workerless_gateway as _gateway


async def _calls(gw: Gateway, calls: list[tuple[str, str, dict | None, dict]]) -> list[Any]:
    out = []
    async with TestClient(TestServer(build_app(gw))) as client:
        for method, path, body, headers in calls:
            resp = await client.request(method, path, json=body, headers=headers)
            out.append((resp.status, await resp.json() if resp.content_type ==
                        "application/json" else None, resp.headers.get("x-request-id")))
    return out


def test_api_key_required_on_v1_only() -> None:
    gw = _gateway(api_keys=("sekret",))
    res = asyncio.run(_calls(gw, [
        ("GET", "/v1/models", None, {}),
        ("GET", "/v1/models", None, {"Authorization": "Bearer wrong"}),
        ("GET", "/v1/models", None, {"Authorization": "Bearer sekret"}),
        ("GET", "/health", None, {}),
    ]))
    assert [r[0] for r in res] == [401, 401, 200, 503]
    assert res[0][1]["error"]["code"] == 401


def test_no_worker_is_503_and_overload_is_429() -> None:
    gw = _gateway()
    body = {"prompt": "hi", "max_tokens": 2}
    res = asyncio.run(_calls(gw, [("POST", "/v1/completions", body, {"x-request-id": "r1"})]))
    assert res[0][0] == 503 and res[0][1]["error"]["type"] == "ServiceUnavailableError"
    assert res[0][2] == "r1"
    gw.in_flight = gw.in_flight_limit()  # the limit is full
    res = asyncio.run(_calls(gw, [("POST", "/v1/completions", body, {})]))
    assert res[0][0] == 429 and res[0][1]["error"]["code"] == 429
    assert "limit of 256 requests" in res[0][1]["error"]["message"]


def test_the_default_in_flight_limit_grows_with_the_serving_workers() -> None:
    """A fixed 256 turned away a fifth of a 64-GPU cluster's load (sim-routing-64gpu)."""
    from gateway.config import in_flight_limit

    assert [in_flight_limit(0, n) for n in (0, 1, 8, 64, 512)] == [256, 256, 256, 2048, 16384]
    assert in_flight_limit(100, 512) == 100  # --max-in-flight wins
    gw = _gateway(max_in_flight=3)
    assert gw.in_flight_limit() == 3


def test_validation_precedes_routing_and_unknown_routes_are_json() -> None:
    gw = _gateway()
    res = asyncio.run(_calls(gw, [
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, {}),
        ("POST", "/v1/chat/completions", {"model": "x", "messages": []}, {}),
        ("GET", "/v1/nothing", None, {}),
    ]))
    assert [r[0] for r in res] == [400, 404, 404]
    assert res[2][1]["error"]["code"] == 404


@pytest.mark.parametrize("path,huge,status", [
    ("/v1/completions", {"prompt": "the quick brown fox jumps over the lazy dog " * 24_000},
     400),
    ("/detokenize", {"tokens": [5 + i % 500 for i in range(600_000)]}, 200),
])
def test_a_huge_body_does_not_stall_other_requests(path: str, huge: dict, status: int,
                                                   ) -> None:
    """A prompt of ~1 MB takes the gateway most of a second to tokenize before it gets
    its 400 (longer than the context), 600k ids ~0.1 s to decode; small requests sent one
    after another once the gateway holds the huge one's body are all answered first
    (milliseconds each): the huge one works on a parsing thread, and the tokenizer lets
    go of the GIL while it encodes or decodes. Done on the event loop, or holding the GIL,
    the huge one would keep the loop from serving them until it was done."""
    gw = _gateway()

    async def run() -> list[tuple[str, int]]:
        received = asyncio.Event()

        @web.middleware
        async def body_received(request: web.Request, handler: Any) -> web.StreamResponse:
            await request.read()  # the handler reads it again, from aiohttp's cache
            if request.path == path:
                received.set()
            return await handler(request)

        app = build_app(gw)
        app.middlewares.append(body_received)  # innermost: after the front's own
        done: list[tuple[str, int]] = []  # in the order the answers came
        async with TestClient(TestServer(app)) as client:
            async def post(name: str, path: str, body: dict) -> None:
                resp = await client.post(path, json=body)
                done.append((name, resp.status))
            big = asyncio.create_task(post("huge", path, huge))
            await asyncio.wait_for(received.wait(), 30)
            for _ in range(10):
                await asyncio.wait_for(post("small", "/tokenize", {"prompt": "hello"}), 30)
            await asyncio.wait_for(big, 60)
        return done

    done = asyncio.run(run())
    assert done == [("small", 200)] * 10 + [("huge", status)]


def test_remote_prefill_decision_fills_the_prefill_peer() -> None:
    from engine.sampling_params import SamplingParams
    from gateway.protocol import GenerateInput
    from gateway.routing.base import Candidate, RouteDecision

    gw = _gateway()
    inp = GenerateInput(model="tiny", prompt_token_ids=[1, 2, 3],
                        params=SamplingParams(max_tokens=4, temperature=0.0),
                        cache_salt="tenant-a", priority=2)
    d = Candidate("d0", "127.0.0.1:1", "decode")
    p = Candidate("p0", "127.0.0.1:2", "prefill")
    req = gw._worker_request(inp, "rid", RouteDecision(d, p, {}), [])
    assert (req.prefill_peer.address, req.prefill_peer.worker_id) == ("127.0.0.1:2", "p0")
    assert req.cache_salt == "tenant-a" and req.priority == 2 and req.request_id.startswith("rid-")
    assert list(req.prompt_token_ids) == [1, 2, 3] and req.sampling.max_tokens == 4
    local = gw._worker_request(inp, "rid", RouteDecision(d, None, {}), [])
    assert not local.HasField("prefill_peer")


def test_a_bodys_request_id_names_the_request_unless_the_header_does() -> None:
    """vLLM's `request_id` field: the request's id when no x-request-id header gives
    one (echoed in the response header and error logs); checked as the header is."""
    gw = _gateway()
    body = {"prompt": "hi", "max_tokens": 2, "request_id": "from-body"}
    res = asyncio.run(_calls(gw, [
        ("POST", "/v1/completions", body, {}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                          "request_id": "chat-body"}, {}),
        ("POST", "/v1/completions", body, {"x-request-id": "from-header"}),
        ("POST", "/v1/completions", body | {"request_id": "has space"}, {}),
        ("POST", "/v1/completions", body | {"request_id": 7}, {}),
    ]))
    assert [(r[0], r[2]) for r in res[:3]] == [(503, "from-body"), (503, "chat-body"),
                                               (503, "from-header")]
    assert [r[0] for r in res[3:]] == [400, 400]
    assert all(r[1]["error"]["param"] == "request_id" for r in res[3:])
