"""`splitserve sim bench`: the simulator's speed and the gateway's routing cost per
request, on a small trace."""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import pytest

from bench import memprobe
from sim import speed
from tests.unit.sim.test_simulator import TRACE


def _bench_args(tmp_path: Path, *flags: str) -> tuple[argparse.Namespace, Path]:
    """`sim bench` arguments on the small trace, and where its JSON goes."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    p = argparse.ArgumentParser()
    speed.add_arguments(p)
    out = tmp_path / "bench.json"
    # the memory probe skipped unless asked for (~10 s at its default size)
    return p.parse_args(["--memprobe-mib", "0", *flags, "--trace", str(trace),
                         "--block-size", "64", "--json", str(out)]), out


def test_bench_reports_speed_and_routing_cost(tmp_path: Path) -> None:
    args, out = _bench_args(tmp_path, "--workers", "4", "--requests", "12",
                            "--route-sample", "6", "--memprobe-mib", "2")
    assert speed.run(args) == 0
    got = json.loads(out.read_text())
    assert got["requests"] == got["completed"] == 12 and got["sim_requests_per_s"] > 0
    # the reference: the machine's memory latency before and after the run, each
    # measured in a process of its own (here over a small region: the plumbing)
    assert set(got["memory"]) == {"before", "after"}
    for probe in got["memory"].values():
        assert probe["region_mib"] == 2 and probe["step_ns"] > 0 and probe["load_ns"] >= 0
        assert probe["cache_mib"] >= 1 and probe["cache_load_ns"] >= 0
    # and the L3 sampled at each tenth, the run paused (left out of its wall time)
    assert len(got["l3_ns_by_tenth"]) == 10 and min(got["l3_ns_by_tenth"]) >= 0
    assert got["peak_rss_mb"] > 10  # a Python process with numpy and the engine
    # which interpreter ran it (its build moves the figures: the Makefile's PY)
    assert got["python"].startswith(platform.python_version() + " from /")
    # a rate per tenth of the arrivals; the projection takes the slower of the run's and
    # the last tenth's (the rate falls as a run ages)
    assert len(got["rate_by_tenth"]) == 10 and min(got["rate_by_tenth"]) > 0
    slowest = min(got["sim_requests_per_s"], got["rate_by_tenth"][-2])
    assert abs(got["projected_1M_s"] - 1e6 / slowest) <= 1e-3 * got["projected_1M_s"]  # rounded
    cost = got["route_us"]
    assert set(cost) == {"lookup", "fill", "route", "total"} and cost["route"] > 0
    assert abs(cost["total"] - (cost["lookup"] + cost["fill"] + cost["route"])) < 0.5


def test_breakdown_splits_the_wall_time_and_changes_nothing(tmp_path: Path) -> None:
    """`--breakdown` accounts the whole run to engine, gateway, index and simulator,
    and wrapping the entry points leaves the simulated results as they were."""
    from sim.accounting import Accounting
    from sim.cluster import Simulator
    from tests.unit.sim.test_simulator import CONFIGS, key, profile, trace_specs

    specs = trace_specs(tmp_path, repeat=3)
    plain = Simulator(CONFIGS["disaggregated"], profile())
    want = key(plain.run(specs))
    sim = Simulator(CONFIGS["disaggregated"], profile())
    acct = Accounting().install(sim)
    acct.start()
    got = key(sim.run(specs))
    acct.stop()
    assert got == want
    split = acct.per_request_us(len(specs))
    assert set(split) == {"engine", "gateway", "index", "simulator"}
    assert all(v > 0 for v in split.values()), split


def test_breakdown_by_tenth_adds_up_to_the_run(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`sim bench --breakdown` splits each tenth of the run too: a part's per-request
    figures over the tenths, weighted by their requests, are its figure for the run."""
    sample = memprobe.CacheProbe.sample

    def slow_sample(self: memprobe.CacheProbe) -> float:  # a probe that takes 0.3 s more
        got = sample(self)
        time.sleep(0.3)
        return got

    monkeypatch.setattr(memprobe.CacheProbe, "sample", slow_sample)
    args, out = _bench_args(tmp_path, "--workers", "4", "--requests", "30",
                            "--route-sample", "0", "--breakdown", "--memprobe-mib", "2")
    assert speed.run(args) == 0
    got = json.loads(out.read_text())
    tenths, whole = got["breakdown_us_by_tenth"], got["breakdown_us"]
    # the L3 probes at the tenths (~0.2 s each, far longer than this run) are left out
    # of the run's wall time and of its parts alike
    run_s = sum(whole.values()) * 30 * 1e-6
    assert abs(run_s - got["wall_s"]) <= 0.1 * got["wall_s"] + 0.05, (run_s, got["wall_s"])
    assert got["wall_s"] < 10 * 0.3, got["wall_s"]  # the probes' 3 s are not in it
    assert len(tenths) == 10 and all(set(t) == set(whole) for t in tenths)
    counts = [3] * 10  # 30 requests: 3 arrive in each tenth
    for part, us in whole.items():
        summed = sum(t[part] * n for t, n in zip(tenths, counts, strict=True)) / 30
        assert abs(summed - us) <= 0.05 * us + 1.0, (part, summed, us)


def test_timing_the_pools_in_the_run_changes_nothing(tmp_path: Path) -> None:
    """`--pool-churn`'s in-run figures wrap every worker's KVCacheManager: the
    simulated results stay as they were (a disaggregated cluster: remote prefills,
    held and released producer blocks)."""
    from sim.cluster import Simulator
    from tests.unit.sim.test_simulator import CONFIGS, key, profile, trace_specs

    specs = trace_specs(tmp_path, repeat=3)
    want = key(Simulator(CONFIGS["disaggregated"], profile()).run(specs))
    sim = Simulator(CONFIGS["disaggregated"], profile())
    timed = speed.RunPoolTimes().install(sim)
    assert key(sim.run(specs)) == want
    assert min(timed.blocks.values()) > 0
    assert all(v > 0 for v in timed.per_block_ns().values())


def test_accounting_charges_each_call_its_own_time() -> None:
    """A wrapped call that calls another is charged without the inner call's time; the
    time outside every wrapped call is the simulator's."""
    from sim.accounting import Accounting

    now = [0.0]

    def tick(dt: float) -> None:
        now[0] += dt

    class Index:
        def lookup_now(self) -> None:
            tick(2.0)

    class Gateway:
        def __init__(self, index: Index) -> None:
            self.index = index

        def route(self) -> None:
            tick(1.0)
            self.index.lookup_now()
            tick(0.5)

    acct = Accounting(clock=lambda: now[0])
    index = Index()
    gw = Gateway(index)
    acct._wrap(index, ("lookup_now",), "index")
    acct._wrap(gw, ("route",), "gateway")
    acct.start()
    tick(4.0)
    gw.route()
    tick(0.25)
    acct.stop()
    assert acct.seconds == {"engine": 0.0, "gateway": 1.5, "index": 2.0, "simulator": 4.25}


def test_a_block_size_override_keeps_the_pool_s_tokens(tmp_path: Path) -> None:
    """`--block-size` keeps the profile's KV memory: 4x the block size, a quarter the
    blocks (as an engine sizing its cache from free memory), in `sim run` and `sim bench`
    alike; every request of the small trace still completes."""
    from sim import run_cli
    from sim.cluster import Simulator
    from sim.profile import load_profile, with_block_size

    h100 = load_profile("h100")
    big = with_block_size(h100, 64)
    assert (big.block_size, big.num_blocks) == (64, h100.num_blocks * 16 // 64)
    assert with_block_size(h100, 16) == h100
    p = argparse.ArgumentParser()
    run_cli.add_arguments(p)
    args = p.parse_args(["--hardware", "h100", "--block-size", "64"])
    assert run_cli.hardware(args) == big
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    sim = Simulator(run_cli.cluster_config(args), run_cli.hardware(args))
    assert {w.kv.pool.num_blocks for w in sim.workers.values()} == {big.num_blocks}
    results = sim.run(run_cli.workload(p.parse_args(
        ["--hardware", "h100", "--block-size", "64", "--trace", str(trace),
         "--requests", "12"])))
    assert len(results) == 12 and all(r.ok for r in results)
    sim.check_integrity()


def test_the_progress_bar_changes_nothing(tmp_path: Path, capsys) -> None:
    """`sim run`'s bar counts the arrivals as the simulator draws them (and shows the
    simulated clock); the phase it reports is the one without it."""
    from sim.run_cli import simulate
    from tests.unit.sim.test_simulator import CONFIGS, key, profile, trace_specs

    specs = trace_specs(tmp_path, repeat=3)
    plain = simulate(CONFIGS["disaggregated"], profile(), specs, "p")
    shown = simulate(CONFIGS["disaggregated"], profile(), specs, "p", progress=len(specs))
    assert key(shown.phase.results) == key(plain.phase.results)
    assert f"{len(specs)}/{len(specs)}" in capsys.readouterr().err


def test_pool_churn_times_the_engines_pool_in_one_in_many_and_in_the_run(
        tmp_path: Path) -> None:
    """`--pool-churn`: the engine's block pool taking, caching and freeing a prompt's
    blocks, per block and step, in one pool, in the run's pools and inside the run
    itself; each take evicts (the pools start full of cached blocks), and a prompt
    longer than a pool is refused. The run's own figures count what its workers' pools
    did."""
    import pytest

    for pools, prompts in ((3, 10), (64, 40)):  # 64: prompts in flight between the steps
        ns = speed.pool_churn(pools, 50, 20, prompts)
        assert set(ns) == set(speed.STEPS) and all(v > 0 for v in ns.values())
    with pytest.raises(ValueError, match="per_request"):
        speed.pool_churn(1, 10, 11, 1)
    args, out = _bench_args(tmp_path, "--workers", "3", "--requests", "8",
                            "--route-sample", "0", "--pool-churn")
    timed = speed.RunPoolTimes()
    install = speed.RunPoolTimes.install
    with pytest.MonkeyPatch.context() as mp:  # keep the run's instance to read its counts
        mp.setattr(speed.RunPoolTimes, "install", lambda self, sim: install(timed, sim))
        assert speed.run(args) == 0
    churn = json.loads(out.read_text())["pool_churn_ns"]
    assert churn["blocks_per_request"] >= 1
    for case in ("one_pool", "run_pools", "in_run"):
        assert set(churn[case]) == set(speed.STEPS) and churn[case]["cache"] > 0
    # every block cached was taken first (a decode window's unused blocks are given
    # back and taken again: counted again); blocks were freed as requests ended
    assert timed.blocks["take"] >= timed.blocks["cache"] > 0
    assert timed.blocks["free"] > 0
