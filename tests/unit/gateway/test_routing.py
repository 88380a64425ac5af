"""Routing plugins, profiles and the router: filter -> score -> pick -> decide."""

from __future__ import annotations

import collections
import sys

import numpy as np
import pytest

from gateway.routing.base import (
    PICKERS,
    SCORERS,
    Candidate,
    CandidateSet,
    RouteRequest,
    clamp01,
)
from gateway.routing.plugins import (
    KVUsageScorer,
    MaxScorePicker,
    PowerOfTwoPicker,
    QueueDepthScorer,
    ReadyRoleFilter,
    ThresholdDecider,
)
from gateway.routing.profile import NoCandidates, Router, RoutingProfile


def cand(wid: str, role: str = "colocated", **kw) -> Candidate:
    return Candidate(worker_id=wid, address=f"{wid}:1", role=role, num_blocks=100, **kw)


REQ = RouteRequest("r", list(range(100)))


def test_filter_keeps_ready_workers_of_the_role() -> None:
    cs = CandidateSet([cand("a"), cand("b", ready=False), cand("p", role="prefill"),
                       cand("d", "decode", num_waiting=3)])
    decodes = ReadyRoleFilter().filter(REQ, cs)
    assert [c.worker_id for c in decodes] == ["a", "d"]
    assert decodes.num_waiting.tolist() == [0, 3] and decodes.pos == {"a": 0, "d": 1}
    assert [c.worker_id for c in ReadyRoleFilter(("prefill",)).filter(REQ, cs)] == ["p"]
    assert ReadyRoleFilter(("colocated", "decode", "prefill")).filter(REQ, cs).ids == \
        ["a", "p", "d"]
    everyone = CandidateSet([cand("a"), cand("d", "decode")])
    assert ReadyRoleFilter().filter(REQ, everyone) is everyone  # nothing to drop: no copy


def test_candidate_set_inflight_update_reaches_its_subsets() -> None:
    cs = CandidateSet([cand("a"), cand("p", role="prefill"), cand("d", "decode")])
    decodes = cs.ready_in(("decode",))
    assert decodes.inflight.tolist() == [0]
    cs.set_inflight("d", 4)
    assert cs.inflight.tolist() == [0, 0, 4] and cs[2].inflight == 4
    assert cs.ready_in(("decode",)).inflight.tolist() == [4]
    assert cs.rows_of(["d", "x", "a"]).tolist() == [2, -1, 0]


def test_candidate_set_rows_of_many_workers_is_kept_and_read_only() -> None:
    """A long list's rows are kept for the next call with the same workers (a popular
    prefix's holders, route after route), read-only since they are shared, and right
    after many other lists pushed older ones out."""
    cs = CandidateSet([cand(f"w{i}") for i in range(100)])
    holders = [f"w{i}" for i in range(99, 9, -1)] + ["gone"]
    rows = cs.rows_of(holders)
    assert rows.tolist() == [*range(99, 9, -1), -1]
    assert cs.rows_of(dict.fromkeys(holders).keys()) is rows
    with pytest.raises(ValueError):
        rows[0] = 0
    for k in range(40):  # other lists, each long enough to be kept
        assert cs.rows_of([f"w{i}" for i in range(k, k + 50)]).tolist() == \
            list(range(k, k + 50))
    assert cs.rows_of(holders).tolist() == [*range(99, 9, -1), -1]
    assert cs.rows_of(["w3", "x"]).tolist() == [3, -1]


def test_candidate_set_load_reports_of_several_rows_at_once() -> None:
    """set_load: each named row gets its own figures (a worker's Candidate made before
    shows the new ones), the others keep theirs, and kept subsets are made again."""
    cs = CandidateSet([cand("a"), cand("p", role="prefill"), cand("d", "decode")])
    before = cs[1]
    decodes = cs.ready_in(("decode",))
    assert decodes.num_running.tolist() == [0]
    cs.set_load([2, 0], [5, 6], [7, 8], [0.25, 0.5], [30, 20])
    assert cs.num_waiting.tolist() == [6, 0, 5] and cs.num_running.tolist() == [8, 0, 7]
    assert cs.kv_usage.tolist() == [0.5, 0.0, 0.25]
    assert (cs[0].num_free_blocks, cs[2].num_free_blocks) == (20, 30)
    assert cs[1] is before  # untouched row: its Candidate kept
    assert cs.ready_in(("decode",)).num_running.tolist() == [7]


def test_a_set_selecting_all_of_itself_is_freed_without_the_cyclic_collector() -> None:
    """ready_in keeps a subset per roles; when the subset is the whole set, keeping it
    must not be a reference to itself: a cycle is freed only by the cyclic collector,
    which the simulator turns off (each load report's set would stay until the end)."""
    cs = CandidateSet([cand("a"), cand("d", "decode")])
    before = sys.getrefcount(cs)
    assert cs.ready_in(("colocated", "decode")) is cs
    assert cs.ready_in(("colocated", "decode")) is cs  # kept, not computed again
    assert sys.getrefcount(cs) == before
    part = cs.ready_in(("decode",))
    assert part is not cs and part.ids == ["d"] and cs.ready_in(("decode",)) is part
    assert sys.getrefcount(cs) == before
    cs.set_inflight("d", 2)  # the subset (a copy of the column) goes; the whole set stays
    assert cs.ready_in(("decode",)).inflight.tolist() == [2]
    assert cs.ready_in(("colocated", "decode")) is cs


def test_scorers_are_in_unit_range_and_prefer_idle() -> None:
    cs = CandidateSet([cand("a", num_waiting=4), cand("b", inflight=1),
                       cand("c", num_running=2, inflight=1)])
    q = QueueDepthScorer().score(REQ, cs)
    assert q.tolist() == pytest.approx([0.0, 1.0, 2 / 3])  # in flight or running: the more
    assert QueueDepthScorer().score(REQ, CandidateSet([cand("a"), cand("b")])).tolist() == \
        [1.0, 1.0]
    kv = KVUsageScorer().score(REQ, CandidateSet([
        cand("a", kv_usage=0.9), cand("b", kv_usage=0.1), Candidate("n", "n:1", "decode"),
        cand("x", kv_usage=1.5), cand("y", kv_usage=float("nan"))]))
    assert kv[0] < kv[1] and kv[2] == 0.0 and all(0 <= s <= 1 for s in kv)
    assert kv[3] == 0.0 and kv[4] == 0.0  # out of range and NaN clamp to [0, 1]



def test_clamp01_maps_nan_to_0_in_place_too() -> None:
    x = np.array([np.nan, -1.0, 0.5, 2.0, np.inf, -np.inf, 0.0])
    want = [0.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.0]
    assert clamp01(x).tolist() == want and np.isnan(x[0])  # a new array by default
    out = np.empty(len(x))
    assert clamp01(x, out=out) is out and out.tolist() == want

def test_pickers() -> None:
    cs = CandidateSet([cand("a"), cand("b"), cand("c")])
    assert MaxScorePicker(seed=0).pick(cs, np.array([0.1, 0.9, 0.5])).worker_id == "b"
    tie = MaxScorePicker(seed=0)
    tied = collections.Counter(tie.pick(cs, np.array([0.9, 0.9, 0.5])).worker_id
                               for _ in range(200))
    assert set(tied) == {"a", "b"}  # ties shared at random, never the lower score
    p2c = PowerOfTwoPicker(seed=1)
    counts = collections.Counter(p2c.pick(cs, np.array([0.0, 0.5, 1.0])).worker_id
                                 for _ in range(300))
    assert counts["a"] == 0  # never the worst of any pair
    assert counts["c"] > counts["b"] > 0


def test_threshold_decider_needs_a_prefill_worker() -> None:
    d = ThresholdDecider(threshold=50)
    p = CandidateSet([cand("p", role="prefill")])
    assert d.decide(REQ, cand("d", "decode"), p, 0)
    assert not d.decide(REQ, cand("d", "decode"), CandidateSet(), 0)
    assert not d.decide(RouteRequest("r", list(range(50))), cand("d", "decode"), p, 0)
    assert not d.decide(REQ, cand("d", "decode"), p, 64)  # 36 tokens left to prefill


def test_profile_from_dict_and_errors() -> None:
    prof = RoutingProfile.from_dict({"scorers": [{"name": "queue", "weight": 2},
                                                 "kv_usage"],
                                     "picker": "max_score",
                                     "decider": {"name": "threshold", "threshold": 10}})
    assert [(s.name, s.weight) for s in prof.scorers] == [("queue", 2.0), ("kv_usage", 1.0)]
    assert prof.picker == "max_score" and prof.decider_threshold == 10
    for bad in ({"scorers": [{"name": "nope"}]}, {"picker": "nope"}, {"bogus": 1},
                {"scorers": []}, {"scorers": [{"name": "queue", "weight": -1}]}):
        with pytest.raises(ValueError):
            RoutingProfile.from_dict(bad)
    assert {"queue", "kv_usage"} <= set(SCORERS.names())
    assert {"max_score", "power_of_two"} <= set(PICKERS.names())


def test_profile_from_yaml(tmp_path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("routing:\n  picker: max_score\n  decider: {threshold: 7}\n")
    prof = RoutingProfile.from_yaml(str(path))
    assert prof.picker == "max_score" and prof.decider_threshold == 7


def test_router_remote_prefill_only_for_decode_with_prefill_available() -> None:
    r = Router(RoutingProfile(picker="max_score", decider_threshold=10, seed=0))
    d = r.route(REQ, [cand("d", "decode"), cand("p", "prefill")])
    assert d.decode.worker_id == "d" and d.prefill is not None and d.prefill.worker_id == "p"
    assert r.route(REQ, [cand("d", "decode")]).prefill is None
    assert r.route(REQ, [cand("c"), cand("p", "prefill")]).prefill is None  # colocated
    busy = r.route(REQ, [cand("a", num_waiting=5), cand("b")])
    assert busy.decode.worker_id == "b"
    with pytest.raises(NoCandidates):
        r.route(REQ, [cand("p", "prefill"), cand("x", ready=False)])


def test_example_profile_in_deploy_parses() -> None:
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    prof = RoutingProfile.from_yaml(os.path.join(root, "deploy", "routing.example.yaml"))
    assert prof.picker == "power_of_two" and prof.decider_threshold == 256
    assert [s.name for s in prof.scorers] == ["prefix_locality", "queue", "kv_usage"]
    assert dict(prof.scorers[0].options)["tiers"]["device"] == 1.0


def _peer_router(**kw) -> Router:
    return Router(RoutingProfile.from_dict({
        "scorers": [{"name": "queue"}], "picker": "max_score", **kw}))


def test_kv_peer_is_the_longest_prefix_holder_beyond_the_decode() -> None:
    d0 = cand("d0", "decode")
    d1 = cand("d1", "decode", num_waiting=5)  # busier: d0 is picked
    p0 = cand("p0", "prefill")
    req = RouteRequest("r", list(range(100)), block_size=16,
                       locality={"d0": ("device",), "d1": ("device",) * 5,
                                 "p0": ("host",) * 3})
    router = _peer_router(decider={"name": "threshold", "threshold": 30})
    dec = router.route(req, [d0, d1, p0])
    assert dec.decode.worker_id == "d0"
    assert (dec.kv_peer and dec.kv_peer.worker_id, dec.kv_peer_blocks) == ("d1", 5)
    # 100 - 80 pulled = 20 uncached tokens: under the threshold, no remote prefill.
    assert dec.prefill is None and dec.predicted_cached(req) == 80
    # Not worth it below min_blocks, and never for a colocated decode.
    assert _peer_router(peer_fetch={"min_blocks": 5}).route(req, [d0, d1]).kv_peer is None
    colo = cand("c0")
    assert _peer_router().route(req, [colo, d1]).kv_peer is None


def test_kv_peer_dropped_when_it_is_the_chosen_prefill_worker() -> None:
    d0, p0 = cand("d0", "decode"), cand("p0", "prefill")
    req = RouteRequest("r", list(range(300)), block_size=16,
                       locality={"p0": ("device",) * 4})
    dec = _peer_router(decider={"name": "threshold", "threshold": 0}).route(req, [d0, p0])
    assert dec.prefill is not None and dec.prefill.worker_id == "p0"
    assert dec.kv_peer is None  # p0 sends those blocks with the rest
    with pytest.raises(ValueError, match="peer_fetch"):
        RoutingProfile.from_dict({"peer_fetch": 3})
    assert RoutingProfile.from_dict(
        RoutingProfile(peer_fetch_min_blocks=7).to_dict()).peer_fetch_min_blocks == 7


def test_candidate_set_from_columns_makes_the_same_candidates() -> None:
    items = [cand("a", num_waiting=2, kv_usage=0.5, inflight=1),
             cand("p", "prefill", ready=False, num_free_blocks=7)]
    cs = CandidateSet.from_columns(["a", "p"], ["a:1", "p:1"], ["colocated", "prefill"],
                                   *([getattr(c, n) for c in items]
                                     for n in CandidateSet.COLUMNS))
    assert list(cs) == items and cs[1].ready is False and isinstance(cs[0].num_waiting, int)
    assert CandidateSet(items)[0] is items[0]
    with pytest.raises(ValueError, match="columns"):
        CandidateSet.from_columns(["a"], ["a:1"], ["colocated"], [True])
