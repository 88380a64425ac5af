"""Locality routing without workers: the prefix_locality scorer, the closed loop's
trust, profiles with scorer options, and the admin API (aiohttp test server)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.core import Gateway
from gateway.http_server import build_app
from gateway.locality import Locality
from gateway.metrics import GatewayMetrics
from gateway.routing.base import Candidate, CandidateSet, RouteRequest
from gateway.routing.locality import DEFAULT_TIER_WEIGHTS, PrefixLocalityScorer
from gateway.routing.profile import Router, RoutingProfile
from kvtransfer.index import IndexLookup
from tests.factories import workerless_gateway as _gateway

HASHES = [bytes([i]) * 16 for i in range(4)]


def req(locality: dict[str, tuple[str, ...]], indexed: int, trust=None) -> RouteRequest:
    return RouteRequest("r", list(range(70)), HASHES, 16, locality=locality,
                        indexed_blocks=indexed, locality_trust=trust or {})


def cand(wid: str, waiting: int = 0) -> Candidate:
    return Candidate(wid, f"{wid}:1", "colocated", num_waiting=waiting, num_blocks=10)


def test_scorer_weights_tiers_and_peers() -> None:
    s = PrefixLocalityScorer()
    cands = CandidateSet([cand("a"), cand("b"), cand("c")])
    r = req({"a": ("device",) * 4, "b": ("device", "host")}, 4)
    a, b, c = s.score(r, cands)
    assert a == pytest.approx(1.0)
    assert b == pytest.approx((1.0 + 0.8 + 2 * 0.2) / 4)  # two blocks from peers
    assert c == pytest.approx(4 * 0.2 / 4)
    custom = PrefixLocalityScorer(tiers={"host": 0.1, "peer": 0.0})
    assert custom.score(r, cands)[1:] == pytest.approx([1.1 / 4, 0.0])
    assert s.score(req({}, 0), cands).tolist() == [0.0, 0.0, 0.0]  # no data: 0, no error
    # a holder that is not a candidate is ignored; a candidate's trust scales its own run
    r = req({"x": ("device",) * 4, "b": ("device", "host")}, 4, trust={"b": 0.5, "c": 0.5})
    assert s.score(r, cands).tolist() == pytest.approx([0.2, 0.5 * 2.2 / 4, 0.2])
    trusted = req({"a": ("device",) * 4}, 4, trust={"a": 0.25})
    assert s.score(trusted, cands)[0] == pytest.approx(0.25)
    # no worker misled: the same scores, to the bit, as every holder's trust 1 spelled out
    runs = {"a": ("device",) * 4, "b": ("device", "host"), "c": ("host",)}
    assert s.score(req(runs, 4), cands).tolist() == \
        s.score(req(runs, 4, trust={"a": 1.0, "b": 1.0, "c": 1.0}), cands).tolist()
    for bad in ({"device": 2}, {"Bad Tier": 0.5}, {"host": "x"}, "device"):
        with pytest.raises(ValueError):
            PrefixLocalityScorer(tiers=bad)  # type: ignore[arg-type]


def test_a_shared_run_scores_as_equal_runs_do() -> None:
    """A run object 100 holders share (as the in-process index hands out) scores as a
    fresh scorer's, to the bit, whatever the request's indexed depth, and an equal run
    in another object scores the same."""
    cands = CandidateSet([cand(f"w{i}") for i in range(101)])
    shared = ("device", "host", "device")
    held = dict.fromkeys((f"w{i}" for i in range(100)), shared)
    kept = PrefixLocalityScorer()
    for indexed in (3, 4, 3):
        r = req(held, indexed)
        assert kept.score(r, cands).tolist() == PrefixLocalityScorer().score(r, cands).tolist()
    copy = dict.fromkeys(held, tuple(list(shared)))  # equal, not the same object
    assert kept.score(req(copy, 4), cands).tolist() == kept.score(req(held, 4), cands).tolist()
    two = {**held, "w0": ("device",) * 4}  # two stretches: the kept one and another
    assert kept.score(req(two, 4), cands).tolist() == \
        PrefixLocalityScorer().score(req(two, 4), cands).tolist()


def test_holders_to_two_depths_score_their_own_runs() -> None:
    """Holders of one prefix to different depths (runs equal up to the shorter's end,
    the last unlike the first, or like it with others between): each scores its run."""
    cands = CandidateSet([cand(f"w{i}") for i in range(101)])
    deep, shallow = ("device",) * 4, ("device",) * 2
    for held in (dict.fromkeys((f"w{i}" for i in range(100)), deep) | {"w99": shallow},
                 {**dict.fromkeys((f"w{i}" for i in range(100)), deep), "w50": shallow}):
        got = PrefixLocalityScorer().score(req(held, 4), cands).tolist()
        peer = DEFAULT_TIER_WEIGHTS["peer"]
        want = [(4.0 if held[f"w{i}"] is deep else 2.0 + 2 * peer) / 4 for i in range(100)]
        assert got == [*want, 4 * peer / 4]


def test_profile_options_round_trip_and_validate() -> None:
    d = {"scorers": [{"name": "prefix_locality", "weight": 3, "tiers": {"disk": 0.3}},
                     "queue"], "picker": "max_score", "decider": {"threshold": 5}, "seed": 1}
    prof = RoutingProfile.from_dict(d)
    assert RoutingProfile.from_dict(prof.to_dict()) == prof
    assert prof.to_dict()["scorers"][0]["tiers"] == {"disk": 0.3}
    for bad in ({"scorers": [{"name": "queue", "tiers": {}}]},  # an option queue lacks
                {"scorers": [{"name": "prefix_locality", "tiers": {"host": 5}}]},
                {"scorers": [{"name": "queue", "weight": "heavy"}]},
                {"scorers": "queue"}):
        with pytest.raises(ValueError):
            RoutingProfile.from_dict(bad)


def test_router_prefers_the_holder_over_a_less_busy_worker() -> None:
    prof = RoutingProfile.from_dict({"scorers": [{"name": "prefix_locality", "weight": 2},
                                                 "queue"], "picker": "max_score", "seed": 0})
    r = Router(prof)
    busy_holder = [cand("a", waiting=3), cand("b")]
    assert r.route(req({"a": ("device",) * 4}, 4), busy_holder).decode.worker_id == "a"
    assert r.route(req({}, 0), busy_holder).decode.worker_id == "b"


def test_prediction_is_capped_and_trust_follows_accuracy() -> None:
    loc = Locality(None, GatewayMetrics(), alpha=0.5, min_trust=0.1)
    base = RouteRequest("r", list(range(64)), HASHES, 16)
    filled = loc.fill(base, IndexLookup(4, {"a": ("device",) * 4, "b": ("host",)}))
    # 64 tokens = 4 full blocks, but the last token is always computed: 3 blocks hit
    assert (filled.cached_tokens("a"), filled.cached_tokens("b"), filled.cached_tokens("c")) \
        == (48, 16, 0) and filled.indexed_blocks == 4
    assert loc.fill(base, None) is base
    loc.observe("a", 48, 48)
    assert loc.trust("a") == 1.0
    loc.observe("a", 48, 0)  # the index claimed blocks the worker did not have
    loc.observe("a", 48, 0)
    assert loc.trust("a") == pytest.approx(0.25)
    for _ in range(10):
        loc.observe("a", 48, 0)
    assert loc.trust("a") == 0.1  # floored
    assert loc.fill(base, IndexLookup(1, {"a": ("device",)})).locality_trust == {"a": 0.1}
    loc.observe("b", 32, 32)  # never misled: trust 1, not copied into each request
    assert loc.trust("b") == 1.0
    assert loc.fill(base, IndexLookup(1, {"b": ("device",)})).locality_trust == {"a": 0.1}
    text = _metrics_text(loc.metrics)
    assert 'splitserve:index_accuracy{worker="a"}' in text
    assert 'splitserve:predicted_cached_tokens_total{worker="a"} 624.0' in text


def _metrics_text(m: GatewayMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(m.registry).decode()


async def _admin(gw: Gateway, calls: list[tuple[str, Any, str | None]]) -> list[Any]:
    out = []
    async with TestClient(TestServer(build_app(gw))) as client:
        for method, body, key in calls:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            data = body if isinstance(body, (str, bytes)) or body is None else None
            resp = await client.request(method, "/admin/v1/routing", data=data,
                                        json=None if data is not None or body is None
                                        else body, headers=headers)
            out.append((resp.status, await resp.json()))
    return out


def test_admin_api_reads_and_swaps_the_profile() -> None:
    gw = _gateway(admin_key="admin-secret")
    old_router = gw.router
    yaml_body = ("routing:\n  scorers:\n    - {name: prefix_locality, weight: 5}\n"
                 "  picker: max_score\n  decider: {name: threshold, threshold: 9}\n")
    res = asyncio.run(_admin(gw, [
        ("GET", None, None),                                   # no key
        ("GET", None, "wrong-key"),                            # wrong key
        ("POST", {"picker": "max_score"}, None),
        ("GET", None, "admin-secret"),
        ("POST", {"picker": "nope"}, "admin-secret"),          # invalid: unchanged
        ("POST", "scorers: [", "admin-secret"),                # not YAML
        ("POST", "[1, 2]", "admin-secret"),                    # not a mapping
        ("POST", yaml_body, "admin-secret"),
        ("GET", None, "admin-secret"),
    ]))
    assert [s for s, _ in res] == [401, 403, 401, 200, 400, 400, 400, 200, 200]
    assert res[3][1] == RoutingProfile().to_dict()
    assert "unknown picker" in res[4][1]["error"]["message"]
    assert res[8][1]["picker"] == "max_score" and res[8][1]["decider"]["threshold"] == 9
    assert [s["name"] for s in res[8][1]["scorers"]] == ["prefix_locality"]
    assert gw.router is not old_router and gw.router.profile.decider_threshold == 9


def test_admin_api_is_off_without_a_key() -> None:
    gw = _gateway()
    res = asyncio.run(_admin(gw, [("GET", None, "anything"), ("GET", None, None)]))
    assert [s for s, _ in res] == [403, 401]
    with pytest.raises(ValueError):
        _gateway(admin_key="short")
