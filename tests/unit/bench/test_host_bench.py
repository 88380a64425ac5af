"""`splitserve bench host`: a small batch end to end; every phase of the decode steps is
accounted for, and the engine it wraps still produces full decode steps."""

from __future__ import annotations

import json

from bench.host_bench import PHASES
from cluster.cli import main


def test_bench_host_small_batch(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert main(["bench", "host", "--batch", "6", "--input-len", "20", "60",
                 "--output-len", "10", "20", "--steps", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    s, phases = result["summary"], result["phases_us_per_step"]
    assert set(PHASES) | {"other", "step"} <= set(phases)
    assert all(phases[k] > 0 for k in PHASES), phases
    assert s["host_us_per_step"] > 0 and s["forward_us_per_step"] > 0
    assert abs(s["host_us_per_request"] * 6 - s["host_us_per_step"]) < 1e-6
    assert s["step_us"] >= s["forward_us_per_step"]
    assert "batch 6: host" in capsys.readouterr().out
