"""`splitserve bench routing --quick` end to end on a tiny model: one cluster of three
colocated workers, the three profiles swapped through the admin API, each phase cold
(its own cache_salt), both workloads (a small hand-made Mooncake trace); the JSON
carries the summary keys, the ceilings match hand-computed values, and cache-aware
routing hits the prefix cache at least as often as round-robin on shared prefixes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.factories import tiny_model_dir
from tests.integration.serving_util import splitserve_cli

PROFILES = ("round_robin", "least_loaded", "cache_aware")

# Two conversations; 512-token trace blocks become 16 tokens. Prompts 32, 48, 32, 48
# tokens; blocks already seen before: 0, 2, 1, 2 -> ceiling (0+32+16+32)/160 = 0.5.
TRACE = [
    {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [0, 1]},
    {"timestamp": 500, "input_length": 1536, "output_length": 4, "hash_ids": [0, 1, 2]},
    {"timestamp": 900, "input_length": 1024, "output_length": 4, "hash_ids": [0, 3]},
    {"timestamp": 1500, "input_length": 1536, "output_length": 4, "hash_ids": [0, 3, 4]},
]


@pytest.mark.timeout(120)
def test_bench_routing_quick(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    out = tmp_path / "out"
    proc = splitserve_cli("bench", "routing", "--quick", "--model", tiny_model_dir("llama"),
                          "--workload", "both", "--trace", str(trace), "--time-scale", "0.1",
                          "--out-dir", str(out), "--json", str(tmp_path / "r.json"),
                          "--no-progress", timeout=110)
    data = json.loads((tmp_path / "r.json").read_text())
    s = data["summary"]
    assert s["failed_requests"] == 0 and s["headline_workload"] == "mooncake"
    for p in PROFILES:
        for key in (f"hit_rate_{p}", f"ttft_p50_{p}", f"ttft_p90_{p}", f"throughput_{p}"):
            assert isinstance(s[key], float) and s[key] >= 0, key
            assert s[key] == s[f"{key}_mooncake"]
        assert s[f"ttft_p50_{p}_shared_prefix"] > 0
    assert s["hit_ceiling"] == s["hit_ceiling_mooncake"] == 0.5
    # 4 groups x 3 requests of 64 + 8 tokens: 8 requests can reuse 64 tokens each.
    assert s["hit_ceiling_shared_prefix"] == round(8 * 64 / (12 * 72), 4)
    sp = {p: s[f"hit_rate_{p}_shared_prefix"] for p in PROFILES}
    assert sp["cache_aware"] >= sp["round_robin"], sp
    assert sp["cache_aware"] > 0  # the index steered some repeat to its prefix's holder
    assert [(ph["config"], ph["params"]["workload"]) for ph in data["phases"]] == [
        (p, w) for w in ("shared-prefix", "mooncake") for p in PROFILES]
    for ph in data["phases"]:
        # Cold start: the phase's first request finds nothing cached, although the same
        # prompt ran in the phase before (another cache_salt).
        first = min(ph["requests"], key=lambda r: r["start_s"])
        assert first["cached_tokens"] == 0, ph["name"]
        assert ph["summary"]["cached_ratio"] <= s[
            f"hit_ceiling_{ph['params']['workload'].replace('-', '_')}"] + 1e-9
    md = (out / "bench-routing.md").read_text()
    assert "cache_aware hit rate" in md and "| cache_aware / mooncake |" in md
    for png in ("bench-routing-compare.png", "bench-routing-hit-rate.png"):
        assert (out / png).read_bytes().startswith(b"\x89PNG") and f"({png})" in md
    assert "targets:" in proc.stdout and "round_robin's" in proc.stdout
