"""`splitserve sim bench`: the simulator's speed and the gateway's routing cost per
request, on a small trace."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sim import speed
from tests.unit.sim.test_simulator import TRACE


def test_bench_reports_speed_and_routing_cost(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    p = argparse.ArgumentParser()
    speed.add_arguments(p)
    out = tmp_path / "bench.json"
    args = p.parse_args(["--workers", "4", "--requests", "12", "--route-sample", "6",
                         "--trace", str(trace), "--block-size", "64", "--json", str(out)])
    assert speed.run(args) == 0
    got = json.loads(out.read_text())
    assert got["requests"] == got["completed"] == 12 and got["sim_requests_per_s"] > 0
    cost = got["route_us"]
    assert set(cost) == {"lookup", "fill", "route", "total"} and cost["route"] > 0
    assert abs(cost["total"] - (cost["lookup"] + cost["fill"] + cost["route"])) < 0.5
