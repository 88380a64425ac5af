"""`splitserve sim bench`: the simulator's speed and the gateway's routing cost per
request, on a small trace."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from sim import speed
from tests.unit.sim.test_simulator import TRACE


def _bench_args(tmp_path: Path, *flags: str) -> tuple[argparse.Namespace, Path]:
    """`sim bench` arguments on the small trace, and where its JSON goes."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    p = argparse.ArgumentParser()
    speed.add_arguments(p)
    out = tmp_path / "bench.json"
    return p.parse_args([*flags, "--trace", str(trace), "--block-size", "64",
                         "--json", str(out)]), out


def test_bench_reports_speed_and_routing_cost(tmp_path: Path) -> None:
    args, out = _bench_args(tmp_path, "--workers", "4", "--requests", "40",
                            "--route-sample", "6")
    assert speed.run(args) == 0
    got = json.loads(out.read_text())
    assert got["requests"] == got["completed"] == 40 and got["sim_requests_per_s"] > 0
    assert got["peak_rss_mb"] > 10  # a Python process with numpy and the engine
    # the machine it ran on, the interpreter's build among it
    assert got["machine"]["python"].startswith(platform.python_version() + " from /")
    assert got["machine"]["cpus"] >= 1 and got["block_size"] == 64
    # a rate per tenth of the arrivals; the projection takes the slower of the run's and
    # the last tenth's (the rate falls as a run ages)
    assert len(got["rate_by_tenth"]) == 10 and min(got["rate_by_tenth"]) > 0
    slowest = min(got["sim_requests_per_s"], got["rate_by_tenth"][-2])
    assert abs(got["projected_1M_s"] - 1e6 / slowest) <= 1e-3 * got["projected_1M_s"]  # rounded
    # the same per CPU second of the process (the steadier figure on a shared machine)
    assert 0 < got["cpu_s"] and len(got["cpu_rate_by_tenth"]) == 10
    assert got["projected_1M_cpu_s"] >= 1e6 / got["cpu_rate_by_tenth"][-2] * (1 - 1e-3)
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


def test_breakdown_by_tenth_adds_up_to_the_run(tmp_path: Path) -> None:
    """`sim bench --breakdown` splits each tenth of the run too: a part's per-request
    figures over the tenths, weighted by their requests, are its figure for the run,
    and the parts add up to the run's wall time."""
    args, out = _bench_args(tmp_path, "--workers", "4", "--requests", "30",
                            "--route-sample", "0", "--breakdown")
    assert speed.run(args) == 0
    got = json.loads(out.read_text())
    tenths, whole = got["breakdown_us_by_tenth"], got["breakdown_us"]
    run_s = sum(whole.values()) * 30 * 1e-6
    assert abs(run_s - got["wall_s"]) <= 0.1 * got["wall_s"] + 0.05, (run_s, got["wall_s"])
    assert len(tenths) == 10 and all(set(t) == set(whole) for t in tenths)
    counts = [3] * 10  # 30 requests: 3 arrive in each tenth
    for part, us in whole.items():
        summed = sum(t[part] * n for t, n in zip(tenths, counts, strict=True)) / 30
        assert abs(summed - us) <= 0.05 * us + 1.0, (part, summed, us)


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


def test_at_scale_runs_default_to_the_trace_s_blocks() -> None:
    """`sim bench` and `sim experiment` run at the Mooncake trace's 512-token blocks
    unless told otherwise (0: the profile's own); the block-size experiment sets its
    own per phase."""
    from sim import experiments
    from sim.workload import MOONCAKE_BLOCK_TOKENS

    assert MOONCAKE_BLOCK_TOKENS == 512
    p = argparse.ArgumentParser()
    speed.add_arguments(p)
    assert p.parse_args([]).block_size == 512 and p.parse_args(["--block-size", "0"]).block_size == 0
    p = argparse.ArgumentParser()
    experiments.add_arguments(p)
    assert p.parse_args(["routing"]).block_size is None  # run(): 512
