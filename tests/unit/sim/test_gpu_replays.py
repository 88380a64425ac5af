"""The GPU profiles against the GPUs, here without one: tests/gpu/test_sim_validation_gpu.py
recorded one real worker's replay of a Mooncake sample on an H100 and on an H200
(docs/results/gpu/sim-validation-{h100,h200}.json, every request). The simulator replays
the same requests on the checked-in profile, whose serving overheads were fitted from
those records' one-at-a-time requests (`sim calibrate --serving-json`), and must land
within the validation's tolerances: TTFT and TPOT p50 within 15 %, the hit rate within 2
points. A change to the latency model, the engine's scheduler or a profile that moves
the simulated GPU off the measured one fails here."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from bench.load import LoadSpec
from sim.calibrate import serving_overheads
from sim.calibrate_gpu import serving_json_results
from sim.config import ClusterConfig
from sim.profile import load_profile
from sim.run_cli import simulate
from sim.workload import from_bench
from tests.gpu.test_sim_validation_gpu import replay_requests
from tests.integration.test_sim_validation import compare

GPU = Path(__file__).resolve().parents[3] / "docs" / "results" / "gpu"


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_profile_matches_its_recorded_gpu_replay(name: str) -> None:
    path = GPU / f"sim-validation-{name}.json"
    rec = json.loads(path.read_text())
    prof = load_profile(name)
    assert rec["device"].startswith(f"NVIDIA {name.upper()}") and rec["profile"] == name
    # The profile's serving overheads are the record's fit (sim calibrate --serving-json).
    results, _ = serving_json_results(str(path))
    fitted = serving_overheads(prof, results)
    assert prof.request_overhead_s == pytest.approx(fitted["request_overhead_s"], rel=1e-9)
    assert prof.token_overhead_s == pytest.approx(fitted["token_overhead_s"], rel=1e-9)
    # The same requests as the GPU replayed (prompt lengths, as many of each).
    reqs = replay_requests(prof)
    trace = rec["phases"]["trace"]
    assert Counter(r.prompt_len for r in reqs) == Counter(r["prompt_len"]
                                                         for r in trace["requests"])
    sim = simulate(ClusterConfig(colocated=1, max_in_flight=256), prof,
                   from_bench(reqs, LoadSpec("trace")), "sim").phase.summary
    assert sim["failed"] == 0
    off, lines = compare(trace["summary"], sim, {**fitted, "speed": 1.0})
    print("\n".join(lines))
    assert not off, f"the simulated {name} is off its recorded replay:\n" + "\n".join(lines)


def test_serving_json_names_what_it_lacks(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"device": "d", "phases": {"trace": {}}}))
    with pytest.raises(SystemExit, match="not a sim validation record"):
        serving_json_results(str(bad))
