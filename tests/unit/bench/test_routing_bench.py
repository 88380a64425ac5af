"""bench.routing_bench's pure parts: trace sampling by conversation, the profiles it
ships (parsed by the gateway), the round_robin picker, config validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.base import BenchError
from bench.routing_bench import PROFILES, RoutingBenchConfig, profile_path, sample_trace
from gateway.routing.base import PICKERS, Candidate, CandidateSet
from gateway.routing.profile import RoutingProfile


def test_sample_trace_keeps_whole_conversations(tmp_path: Path) -> None:
    recs = [{"timestamp": i, "input_length": 512, "output_length": 1, "hash_ids": h}
            for i, h in enumerate([[0, 1], [0, 2], [0, 1, 5], [0, 3], [0, 2, 6], [0, 3, 7]])]
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "s.jsonl"
    sample_trace(str(src), 2, 100, str(out))
    kept = [json.loads(x)["hash_ids"] for x in out.read_text().splitlines()]
    assert kept == [[0, 1], [0, 1, 5], [0, 3], [0, 3, 7]]  # conversations 0 and 2
    sample_trace(str(src), 1, 3, str(out))
    assert len(out.read_text().splitlines()) == 3
    src.write_text('{"timestamp": 0}\n')
    with pytest.raises(BenchError, match="t.jsonl:1"):
        sample_trace(str(src), 1, 3, str(out))


def test_shipped_profiles_parse_and_differ() -> None:
    profiles = {p: RoutingProfile.from_yaml(profile_path(p)) for p in PROFILES}
    assert profiles["round_robin"].picker == "round_robin"
    assert "prefix_locality" not in {s.name for s in profiles["least_loaded"].scorers}
    assert "prefix_locality" in {s.name for s in profiles["cache_aware"].scorers}


def test_round_robin_picker_rotates_whatever_the_scores() -> None:
    cs = CandidateSet([Candidate(w, f"{w}:1", "colocated") for w in ("c", "a", "b")])
    picker = PICKERS.create("round_robin")
    got = [picker.pick(cs, np.array([1.0, 0.0, 0.0])).worker_id for _ in range(6)]
    assert got == ["a", "b", "c", "a", "b", "c"]
    with pytest.raises(ValueError):
        picker.pick(CandidateSet(), np.array([]))


def test_config_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="2 workers"):
        RoutingBenchConfig(workers=1, workload="shared-prefix")
    with pytest.raises(BenchError, match="does not exist"):
        RoutingBenchConfig(workload="mooncake", trace_path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(BenchError, match="--workload"):
        RoutingBenchConfig(workload="sharegpt")
