"""The HTTP front without workers: API keys, overload (429), no worker (503), request
ids and unknown routes, through aiohttp's test server on loopback."""

from __future__ import annotations

import asyncio
from typing import Any

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
    gw.in_flight = gw.config.max_in_flight  # the limit is full
    res = asyncio.run(_calls(gw, [("POST", "/v1/completions", body, {})]))
    assert res[0][0] == 429 and res[0][1]["error"]["code"] == 429


def test_validation_precedes_routing_and_unknown_routes_are_json() -> None:
    gw = _gateway()
    res = asyncio.run(_calls(gw, [
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, {}),
        ("POST", "/v1/chat/completions", {"model": "x", "messages": []}, {}),
        ("GET", "/v1/nothing", None, {}),
    ]))
    assert [r[0] for r in res] == [400, 404, 404]
    assert res[2][1]["error"]["code"] == 404


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
