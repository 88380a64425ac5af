"""The gateway in a process of its own (sim/split.py) computes what one process does:
the same requests, token times, worker figures, transfers, index and trust, for every
kind of cluster the simulator runs (colocated, disaggregated with peer fetch, tiers,
pools that preempt, a gateway turning requests away, load reports read at every route)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bench.datasets import LengthDist
from sim.cluster import Simulator
from sim.config import ClusterConfig
from sim.segments import Runs, runs_of
from sim.split import RemoteGateway
from sim.workload import synthetic
from tests.unit.sim.test_simulator import CONFIGS, full_key, profile, trace_specs


def outcome(cfg: ClusterConfig, specs, split: bool):
    sim = Simulator(replace(cfg, gateway_process=split), profile())
    assert isinstance(sim.gateway, RemoteGateway) == split
    res = sim.run(specs)
    sim.check_integrity()
    return full_key(sim, res, hashes=False), sim.stats


@pytest.mark.parametrize("name", ["colocated", "disaggregated", "tiers",
                                  "disaggregated-tiers", "preempting", "overloaded",
                                  "reports-every-route"])
def test_two_processes_compute_what_one_does(tmp_path: Path, name: str) -> None:
    specs = trace_specs(tmp_path, repeat=8, scale=0.1)
    if name == "disaggregated-tiers":
        cfg = replace(CONFIGS["disaggregated"], num_blocks=400, host_blocks=60,
                      disk_blocks=300)
    elif name == "preempting":
        specs = list(synthetic(60, 50.0, LengthDist(mean=100), LengthDist(mean=60), seed=3))
        cfg = ClusterConfig(colocated=2, num_blocks=40)
    elif name == "overloaded":  # the gateway's in-flight limit turns requests away
        specs = list(synthetic(80, 400.0, LengthDist(mean=300), LengthDist(mean=40), seed=5))
        cfg = ClusterConfig(colocated=2, max_in_flight=3)
    elif name == "reports-every-route":
        cfg = replace(CONFIGS["colocated"], report_interval_s=0.0)
    else:
        cfg = CONFIGS[name]
    one, one_stats = outcome(cfg, specs, split=False)
    two, two_stats = outcome(cfg, specs, split=True)
    assert one == two
    assert one_stats.events == two_stats.events and one_stats.windows == two_stats.windows
    if name == "overloaded":
        assert one_stats.rejected > 0
    if name.startswith("disaggregated"):
        assert one_stats.remote_prefills > 0


def test_hash_runs_round_trip() -> None:
    """What an arrival sends for its prompt's hashes gives them back, in order, and the
    index walks them as it walks the ints."""
    from sim.index import InProcessBlockIndex

    hashes = [5 << 5 | 3, 5 << 5 | 4, 5 << 5 | 5, 9 << 5, 9 << 5 | 1, 7 << 5 | 31, 8 << 5]
    runs = Runs(runs_of(hashes))
    assert list(runs) == hashes and len(runs) == len(hashes) and runs[2:4] == hashes[2:4]
    index = InProcessBlockIndex(lambda: 0.0)
    index.apply_device("a", hashes[:5])
    index.apply_device("b", hashes[:2])
    assert index.lookup_now(runs) == index.lookup_now(hashes)
    assert index.lookup_now(runs).num_blocks == 5


def test_the_gateway_process_failing_fails_the_run(tmp_path: Path, monkeypatch) -> None:
    """A route that raises over there raises here, with its traceback."""
    from sim.gateway import SimGateway

    def broken(self, req):
        raise ValueError("a broken router")

    monkeypatch.setattr(SimGateway, "route", broken)  # the forked process inherits it
    sim = Simulator(replace(CONFIGS["colocated"], gateway_process=True), profile())
    with pytest.raises(RuntimeError, match="(?s)gateway's process failed.*a broken router"):
        sim.run(trace_specs(tmp_path, repeat=1))


def test_sim_bench_runs_with_the_gateway_in_its_own_process(tmp_path: Path) -> None:
    """`sim bench --gateway-process`: the run, its figures and what it says it ran on;
    the options that time this process's parts are refused with it."""
    import json

    from sim import speed
    from tests.unit.sim.test_speed import _bench_args

    args, out = _bench_args(tmp_path, "--workers", "4", "--requests", "12",
                            "--gateway-process")
    assert speed.run(args) == 0
    got = json.loads(out.read_text())
    assert got["requests"] == got["completed"] == 12 and got["gateway_process"] is True
    assert "route_us" not in got  # routing happened over there
    waited = got["waited_s"]  # each process's waits for the other, within the run
    assert set(waited) == {"workers", "gateway"}
    assert all(0 <= w <= got["wall_s"] for w in waited.values())
    args, _ = _bench_args(tmp_path, "--workers", "4", "--requests", "12",
                          "--gateway-process", "--breakdown")
    with pytest.raises(SystemExit, match="not with --gateway-process"):
        speed.run(args)


def test_the_channel_carries_batches_larger_than_its_rings_and_sees_the_other_end_go() -> None:
    """The shared-memory channel between the two processes: batches of every size, many
    times around a small ring (one larger than the ring goes in parts), in order both
    ways, with the reader sleeping between them; then the other process's end reads as
    EOFError."""
    import os
    import random
    import time

    from sim.channel import fork_channel

    rng = random.Random(7)
    batches = [[("m", i, "x" * rng.choice((0, 10, 900, 5000)))
                for i in range(rng.randint(1, 30))] for _ in range(200)]
    ch, pid = fork_channel(size=4096)
    if pid == 0:  # echoes each batch back once it has it all, then goes when told
        code = 1
        try:
            got = []
            while (msg := ch.recv()) != "stop":
                got.append(msg)
                if msg[1] == -1:
                    for m in got:
                        ch.send(("echo", m))
                    ch.flush()
                    got = []
            code = 0
        finally:
            os._exit(code)
    try:
        for i, batch in enumerate(batches):
            for msg in batch:
                ch.send(msg)
            ch.send(("m", -1, ""))
            ch.flush()
            if i % 50 == 0:  # the other side has gone to sleep on its wake fd
                time.sleep(0.01)
            assert [ch.recv() for _ in range(len(batch) + 1)] == \
                [("echo", m) for m in [*batch, ("m", -1, "")]]
        ch.send("stop")
        ch.flush()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with pytest.raises(EOFError, match="has gone"):
            ch.recv()
    finally:
        ch.close()
