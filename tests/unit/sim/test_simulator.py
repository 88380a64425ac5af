"""The simulator: deterministic per seed, conserving (every request completes or is
rejected, every block comes back), and routing with the production router (a change to
a scorer changes the simulated outcome)."""

from __future__ import annotations

import bisect
import collections
import gc
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from bench.datasets import LengthDist
from gateway.routing.locality import PrefixLocalityScorer
from gateway.routing.profile import RoutingProfile
from sim.cluster import Simulator
from sim.config import ClusterConfig
from sim.profile import load_profile
from sim.workload import BlockHasher, SimRequestSpec, mooncake, shared_prefix, synthetic

# Three conversations of a Mooncake-shaped trace: turns extend their predecessor.
TRACE = [{"timestamp": t, "input_length": 512 * len(h) - 100, "output_length": o,
          "hash_ids": h} for t, o, h in [
    (0, 40, [0, 1, 2]), (100, 20, [0, 3]), (300, 30, [0, 1, 2, 4, 5]),
    (350, 10, [0, 6, 7, 8]), (600, 25, [0, 3, 9]), (900, 12, [0, 1, 2, 4, 5, 10]),
    (950, 30, [0, 6, 7, 8, 11]), (1200, 8, [0, 3, 9, 12, 13])]]


def trace_specs(tmp_path: Path, repeat: int = 6, scale: float = 0.2) -> list[SimRequestSpec]:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    return list(mooncake(str(path), block_tokens=64, time_scale=scale, repeat=repeat))


def profile(**over: object):
    return replace(load_profile("h100"), num_blocks=400, max_num_seqs=8,
                   max_num_batched_tokens=512, **over)


def run(cfg: ClusterConfig, specs: list[SimRequestSpec], **over: object):
    sim = Simulator(cfg, profile(**over))
    return sim, sim.run(specs)


def key(results):
    return [(r.ok, r.ttft_s, r.e2e_s, r.cached_tokens, r.output_len, tuple(r.itl_s))
            for r in results]


CONFIGS = {
    "colocated": ClusterConfig(colocated=3),
    "disaggregated": ClusterConfig(prefill=2, decode=2, colocated=0,
                                   routing=RoutingProfile(decider_threshold=64, seed=3)),
    "tiers": ClusterConfig(colocated=2, num_blocks=48, host_blocks=40, disk_blocks=200),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_seed_same_output(tmp_path: Path, name: str) -> None:
    specs = trace_specs(tmp_path)
    _, a = run(CONFIGS[name], specs)
    _, b = run(CONFIGS[name], specs)
    assert key(a) == key(b)
    assert all(r.ok for r in a) and len(a) == len(specs)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_conservation(tmp_path: Path, name: str) -> None:
    """Every request completes or is rejected; at the end no block is held (the pools'
    free counts return to their size) and every pool's invariants hold."""
    specs = trace_specs(tmp_path, repeat=10, scale=0.05)
    cfg = replace(CONFIGS[name], max_in_flight=12)
    sim, res = run(cfg, specs)
    assert len(res) == len(specs)
    assert sum(r.ok for r in res) + sim.stats.rejected + sim.stats.stalled \
        + sim.stats.invalid == len(specs)
    assert sim.stats.rejected > 0  # the gateway limit was hit at this load
    assert all(r.output_len == s.output_len for r, s in zip(res, specs) if r.ok)
    sim.check_integrity()
    for w in sim.workers.values():
        assert not w.kv.req_blocks and not w.pins.counts and not w.scheduler.held
        assert w.kv.pool.num_free_blocks == w.kv.pool.num_blocks, w.worker_id
    if name == "disaggregated":
        assert sim.stats.remote_prefills > 0 and sim.stats.transfer_bytes["prefill"] > 0


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_run_makes_no_cyclic_garbage(tmp_path: Path, name: str) -> None:
    """A run has the cyclic collector off (sim/collector.py): what it leaves in reference
    cycles stays until it ends (before: each load report's candidate set, ~5 KB a
    request at 512 workers). Counted: the garbage of this project's types made by the
    run (earlier tests may leave cycles of their own, e.g. matplotlib's figures)."""
    specs = trace_specs(tmp_path)
    sim = Simulator(CONFIGS[name], profile())
    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    enabled = gc.isenabled()
    gc.disable()
    try:
        sim.run(specs)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        kinds = collections.Counter(
            f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
            if type(o).__module__.split(".")[0] in ("sim", "gateway", "engine", "kvtransfer")
            and id(o) not in before)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert sim.stats.events > len(specs) and not kinds, kinds


def test_a_run_leaves_what_it_keeps_in_the_oldest_generation(tmp_path: Path) -> None:
    """The collector is back on after a run, and what the run made and kept (its
    results, index entries) is in the oldest generation: left young, the first young
    collection walked all of it (0.36 s after 40,000 requests at 512 workers)."""
    sim, res = run(CONFIGS["colocated"], trace_specs(tmp_path))
    assert gc.isenabled() and gc.is_tracked(res[0])
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert all(id(r) in oldest for r in res)


def test_a_request_the_engine_refuses_fails_alone() -> None:
    """A prompt longer than the worker's KV pool gets the engine's 400 and does not hold
    up the queue behind it (head-of-line forever)."""
    specs = [SimRequestSpec(0.01 * i, n, 4, ((i, n),)) for i, n in
             enumerate([64, 64, 600, 64, 64])]
    sim, res = run(ClusterConfig(colocated=1, num_blocks=20), specs)
    assert [r.ok for r in res] == [True, True, False, True, True]
    assert res[2].error.startswith("invalid: the request needs 38 KV blocks")
    assert sim.stats.invalid == 1 and sim.stats.stalled == 0
    sim.check_integrity()


def test_tiers_restore_evicted_prefixes() -> None:
    """Six 16-block system prompts take turns on a 48-block device: the evicted ones
    come back from host DRAM or disk (the real OffloadConnector plans the restores),
    which raises the hit rate over the same cluster without tiers."""
    specs = shared_prefix(6, 5, 256, 16, 4, rate=20.0, seed=2)
    base = ClusterConfig(colocated=1, num_blocks=48)
    sim0, res0 = run(base, specs)
    sim, res = run(replace(base, host_blocks=32, disk_blocks=128), specs)
    w = sim.workers["colocated-0"]
    assert w.tiers is not None and w.tiers.loaded.get("host", 0) + w.tiers.loaded.get(
        "disk", 0) > 0
    assert sim.stats.transfer_bytes.get("host", 0) + sim.stats.transfer_bytes.get(
        "disk", 0) > 0
    assert sum(r.cached_tokens for r in res) > sum(r.cached_tokens for r in res0)
    sim.check_integrity()


def test_peer_fetch_pulls_from_the_holder(tmp_path: Path) -> None:
    """A decode worker that lacks a prefix another decode holds pulls it (FetchKV)
    instead of having the prefill worker recompute it."""
    specs = shared_prefix(2, 6, 1024, 32, 8, rate=40.0, seed=1)
    cfg = ClusterConfig(prefill=1, decode=2, colocated=0, routing=RoutingProfile.from_dict(
        {"scorers": [{"name": "queue"}], "picker": "round_robin", "decider":
         {"name": "threshold", "threshold": 64}, "peer_fetch": {"min_blocks": 2}}))
    sim, res = run(cfg, specs)
    assert all(r.ok for r in res)
    assert sim.stats.peer_fetches > 0 and sim.stats.transfer_bytes["peer"] > 0
    off = replace(cfg, routing=replace(cfg.routing, peer_fetch_min_blocks=0))
    sim_off, res_off = run(off, specs)
    assert sim_off.stats.peer_fetches == 0
    assert sum(r.cached_tokens for r in res) > sum(r.cached_tokens for r in res_off)


def test_the_router_is_the_production_code(tmp_path: Path, monkeypatch) -> None:
    """Patching the production prefix-locality scorer changes what the simulator does:
    the simulated gateway calls gateway.routing's own plugins."""
    specs = trace_specs(tmp_path, repeat=4, scale=0.5)
    cfg = ClusterConfig(colocated=4, routing=RoutingProfile.from_dict(
        {"scorers": [{"name": "prefix_locality", "weight": 2.0}, {"name": "queue"}],
         "picker": "max_score", "seed": 0}))
    _, base = run(cfg, specs)
    calls = []
    real = PrefixLocalityScorer.score

    def blind(self, req, candidates):  # the scorer forgets where prefixes live
        calls.append(len(candidates))
        return [0.0 for _ in real(self, req, candidates)]

    monkeypatch.setattr(PrefixLocalityScorer, "score", blind)
    _, patched = run(cfg, specs)
    assert len(calls) == len(specs)
    hits = sum(r.cached_tokens for r in base), sum(r.cached_tokens for r in patched)
    assert hits[0] > hits[1], hits


DIGEST = """
import hashlib, json, sys
sys.path.insert(0, "tests/unit/sim")
from pathlib import Path
from test_simulator import CONFIGS, key, run, trace_specs
from dataclasses import replace
specs = trace_specs(Path(sys.argv[1]), repeat=4, scale=0.2)
out = [key(run(replace(CONFIGS[n], max_in_flight=10), specs)[1]) for n in sorted(CONFIGS)]
print(hashlib.sha256(json.dumps(out).encode()).hexdigest())
"""


def test_same_seed_same_output_across_processes(tmp_path: Path) -> None:
    """String hashing is salted per process (PYTHONHASHSEED): no set or dict order of
    worker ids may leak into the results."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    digests = set()
    for seed in ("1", "2"):
        proc = subprocess.run([sys.executable, "-c", DIGEST, str(tmp_path)], cwd=root,
                              env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        digests.add(proc.stdout.strip())
    assert len(digests) == 1


def full_key(sim, results, hashes: bool = True):
    """Everything a run reports: per request, per worker, transfers, the index; a tier's
    hashes in LRU order (`hashes`), else how many it holds."""
    workers = [(w.worker_id, w.steps, w.tokens_computed, w.requests_done, w.busy_s,
                w.kv.prefix_hits, w.kv.pool.num_free_blocks,
                [(name, list(slots) if hashes else len(slots)) for name, slots in w.tiers.tiers]
                if w.tiers else None)
               for w in sim.workers.values()]
    st = sim.stats
    return (key(results), [r.error for r in results], workers,
            sorted(st.transfer_bytes.items()), st.remote_prefills, st.peer_fetches,
            st.rejected, st.stalled, sim.index.num_entries(),
            trust(sim))


def trust(sim):
    """The gateway's per-worker trust at the end (its Locality's)."""
    return sorted(sim.gateway.locality._accuracy.items())


@pytest.mark.parametrize("name", ["colocated", "disaggregated", "preempting", "tiers",
                                  "disaggregated-tiers"])
def test_decode_windows_are_exact(tmp_path: Path, name: str) -> None:
    """A decode window (several decode iterations as one scheduler step) changes
    nothing: the same requests, token times, ITL gaps, worker figures and index as one
    scheduler step per iteration, here too when pools run dry and requests are
    preempted, when new work cuts windows short, and with offload tiers (the blocks the
    iterations fill saved at their ends: the same tier contents in the same LRU order,
    also where a remote prefill's blocks land mid-window)."""
    if name == "preempting":
        specs = list(synthetic(60, 50.0, LengthDist(mean=100), LengthDist(mean=60), seed=3))
        cfg = ClusterConfig(colocated=2, num_blocks=40)
    elif name == "disaggregated-tiers":
        specs = trace_specs(tmp_path, repeat=6, scale=0.1)
        cfg = replace(CONFIGS["disaggregated"], num_blocks=400, host_blocks=60,
                      disk_blocks=300)
    else:
        specs, cfg = trace_specs(tmp_path, repeat=6, scale=0.1), CONFIGS[name]
    sim, res = run(cfg, specs)
    ref_sim, ref = run(replace(cfg, decode_windows=False), specs)
    assert full_key(sim, res) == full_key(ref_sim, ref)
    assert sim.stats.windows > 0 and ref_sim.stats.windows == 0  # windows did run
    if name == "preempting":
        assert sum(w.scheduler.num_preemptions for w in sim.workers.values()) > 0
    sim.check_integrity()


@pytest.mark.parametrize("name", ["colocated", "disaggregated", "tiers",
                                  "disaggregated-tiers"])
def test_recycled_hashes_change_nothing(tmp_path: Path, name: str) -> None:
    """The hasher names a chain again once nothing holds its hashes (sim/workload.py):
    a run that recycles chains every few requests gives what one naming every chain anew
    gives (the same requests, worker figures, transfers, index, tier sizes). A recycled
    hash some pool, tier, index entry or request still knew would be a false hit there."""
    cfg = replace(CONFIGS["disaggregated"], num_blocks=400, host_blocks=60, disk_blocks=300) \
        if name == "disaggregated-tiers" else CONFIGS[name]
    specs = trace_specs(tmp_path, repeat=40, scale=0.1)

    def outcome(hasher: BlockHasher):
        sim = Simulator(cfg, profile())
        sim.hasher = hasher
        res = sim.run(specs)
        sim.check_integrity()
        return full_key(sim, res, hashes=False)  # the hash values differ, by design

    recycling = BlockHasher(16, batch=8)
    assert outcome(recycling) == outcome(BlockHasher(16, recycle=False))
    assert recycling.recycled > 100  # 140-450 of the 800-1100 chains named


@pytest.mark.parametrize("combine", ["max", "sum"])
def test_window_iteration_times_are_the_steps_times(combine: str) -> None:
    """A decode window's clock (WindowClock) gives each iteration exactly (to the bit)
    what `seconds` gives that iteration as a one-token step, and the clock those steps
    keep, whichever way it is asked."""
    from sim.latency import LatencyModel

    lat = LatencyModel(replace(load_profile("h100"), combine=combine))
    for computed in ([7], [130, 4000, 77], list(range(1, 400, 13))):
        rows, base = len(computed), sum(computed)
        want = [lat.seconds(rows, rows, base + rows * j, base + rows * j, rows)
                for j in range(1, 65)]
        assert [lat.window_clock(computed, 0.0).dt(i) for i in range(1, 65)] == want
        # a window's clock: the steps' sequential sums, to the bit
        clock = lat.window_clock(computed, 1234.5678, 3e-5)
        dts = [d + 3e-5 for d in want]
        assert [clock.dt(i) for i in range(1, 65)] == dts
        ends = list(itertools.accumulate(dts, initial=1234.5678))[1:]
        assert clock.ends(64) == ends
        # a walk: the iteration running at a time (what a bisection of the ends gives,
        # capped), its end and start, a worker's busy time summed as the steps would,
        # and the ends of the iterations asked for
        for now in (0.0, ends[0], ends[0] + 1e-9, ends[30], ends[31] - 1e-9, ends[63],
                    ends[63] + 1.0, math.inf):
            for limit in (1, 31, 64):
                i = min(bisect.bisect_left(ends, now) + 1, limit)
                marks = [m for m in (1, 1, 5, 30, 31, 40, 64) if m <= i]
                assert clock.walk(limit, 0.25, now, marks) == (
                    i, ends[i - 1], ends[i - 2] if i > 1 else -math.inf,
                    list(itertools.accumulate(dts[:i], initial=0.25))[-1],
                    [ends[m - 1] for m in marks])
        assert clock.walk(64, 0.25)[:2] == (64, ends[63])


def test_remote_kv_landing_cuts_the_decode_window_first(tmp_path: Path) -> None:
    """A decode worker in a decode window (its later iterations' blocks taken ahead)
    must be cut to the present before a remote prefill's blocks land and are cached:
    1P:7D on the checked-in h100 profile, 600 records of every 10th Mooncake
    conversation at 1 req/s per GPU, stopped with 'unget of block N: hash cached again'
    when the landing came first. Every request completes or is rejected, every block
    comes back."""
    import os

    from bench.routing_bench import sample_trace
    from sim.run_cli import MOONCAKE_TRACE
    from sim.workload import trace_rate

    if not os.path.isfile(MOONCAKE_TRACE):
        pytest.skip(f"no Mooncake trace at {MOONCAKE_TRACE}")
    sampled = sample_trace(MOONCAKE_TRACE, 10, 1000, str(tmp_path / "trace.jsonl"))
    specs = list(mooncake(sampled, limit=600, time_scale=trace_rate(sampled, 1000) / 8))
    sim = Simulator(ClusterConfig(prefill=1, decode=7, colocated=0, seed=0,
                                  routing=RoutingProfile(seed=0)), load_profile("h100"))
    results = sim.run(specs)
    assert len(results) == 600 and sim.stats.remote_prefills > 0
    sim.check_integrity()
