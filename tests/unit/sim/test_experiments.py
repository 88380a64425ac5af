"""`splitserve sim experiment`: a report per experiment, and the same figures whether
its phases run one after the other or in parallel processes (each is its own seeded
simulation)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sim import experiments
from tests.unit.sim.test_simulator import TRACE


def test_experiment_report_is_the_same_serial_and_parallel(tmp_path: Path) -> None:
    name = "routing"
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE * 3))
    p = argparse.ArgumentParser()
    experiments.add_arguments(p)
    got = {}
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}"
        args = p.parse_args([name, "--workers", "4", "--requests", "20", "--sample", "1",
                             "--rates", "2", "--trace", str(trace), "--out-dir", str(out),
                             "--jobs", str(jobs)])
        assert experiments.run(args) == 0
        stem = f"sim-{name}-4gpu"
        assert (out / f"{stem}.md").is_file() and (out / f"{stem}-goodput.png").is_file()
        got[jobs] = json.loads((out / f"{stem}.json").read_text())
    assert got[1]["summary"] == got[2]["summary"]
    assert [ph["summary"] for ph in got[1]["phases"]] == \
        [ph["summary"] for ph in got[2]["phases"]]
    assert [ph["name"] for ph in got[1]["phases"]] == [
        f"{r} @ 2/GPU" for r in ("round_robin", "least_loaded", "cache_aware")]
    assert all(ph["summary"]["completed"] == ph["summary"]["requests"] == 20
               for ph in got[1]["phases"])


def test_tiers_experiment_at_another_block_size_keeps_the_memory(tmp_path: Path) -> None:
    """`--block-size` scales every pool the experiment sizes from the profile (the
    device cache fractions, their host and disk tiers) to the same tokens."""
    from sim.profile import load_profile

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE * 3))
    p = argparse.ArgumentParser()
    experiments.add_arguments(p)
    out = tmp_path / "bs64"
    args = p.parse_args(["tiers", "--workers", "4", "--requests", "12", "--sample", "1",
                         "--rates", "2", "--trace", str(trace), "--out-dir", str(out),
                         "--jobs", "1", "--block-size", "64"])
    assert experiments.run(args) == 0
    got = json.loads((out / "sim-tiers-4gpu.json").read_text())
    assert got["config"]["block_size"] == 64
    assert all(ph["summary"]["completed"] == ph["summary"]["requests"] == 12
               for ph in got["phases"])
    h100 = load_profile("h100")
    pool = h100.num_blocks * h100.block_size // 64  # an H100's cache in 64-token blocks
    assert [ph["params"]["device_blocks"] for ph in got["phases"]] == \
        [pool // frac for frac in (8, 4, 2) for _ in range(3)] + \
        [pool // frac for frac in (8, 4, 2) for _ in range(2)]
    peer = [ph for ph in got["phases"] if "peer" in ph["config"]]
    assert [ph["params"]["rate_per_gpu"] for ph in peer] == [0.5] * 6  # --peer-rate's default
    assert set(got["summary"]) >= {f"{k} peer fetch 1/{f}" for k in ("hit_rate", "ttft_p50")
                                   for f in (8, 4, 2)}


def test_the_whole_trace_is_its_own_report(tmp_path: Path) -> None:
    """Every record of the trace (`--sample 1`, more requests than it has): the report
    is named for it, says so, and counts the records a phase replayed."""
    records = [json.dumps(r) + "\n" for r in TRACE * 2]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(records))
    p = argparse.ArgumentParser()
    experiments.add_arguments(p)
    args = p.parse_args(["routing", "--workers", "4", "--requests", "100000", "--sample",
                         "1", "--rates", "2", "--trace", str(trace), "--out-dir",
                         str(tmp_path), "--jobs", "1"])
    assert experiments.run(args) == 0
    got = json.loads((tmp_path / "sim-routing-4gpu-full.json").read_text())
    assert got["config"]["trace_sample"] == "the whole trace"
    assert got["config"]["requests_per_phase"] == len(records)
    assert "(the whole trace)" in got["notes"][1]
    assert all(ph["summary"]["requests"] == len(records) for ph in got["phases"])


def test_block_size_experiment_holds_each_size_to_the_engines(tmp_path: Path) -> None:
    """One phase per block size, each with the profile's KV memory in its blocks; the
    16-token phase is the plain simulation at the profile's block size (the same
    figures), and the headline holds every other size's answers against it."""
    import pytest

    from bench.base import BenchError
    from sim.config import ClusterConfig
    from sim.profile import load_profile
    from sim.run_cli import routing_profile, simulate
    from sim.workload import mooncake, trace_rate

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE * 4))
    p = argparse.ArgumentParser()
    experiments.add_arguments(p)
    argv = ["block-size", "--workers", "4", "--requests", "24", "--sample", "1", "--rates",
            "2", "--trace", str(trace), "--out-dir", str(tmp_path), "--jobs", "1"]
    with pytest.raises(BenchError, match="drop --block-size"):
        experiments.run(p.parse_args([*argv, "--block-size", "64"]))
    assert experiments.run(p.parse_args(argv)) == 0
    got = json.loads((tmp_path / "sim-block-size-4gpu.json").read_text())
    assert got["config"]["block_size"] == "per phase"
    phases = got["phases"]
    assert [(ph["params"]["block_tokens"], ph["params"]["reseeded"]) for ph in phases] == \
        [(bs, 0) for bs in experiments.BLOCK_SIZES] + [(16, 1), (16, 2)]
    h100 = load_profile("h100")
    assert h100.block_size == experiments.BLOCK_SIZES[0]
    for ph in phases:
        assert ph["summary"]["completed"] == ph["summary"]["requests"] == 24
        # the same tokens of KV memory at every size, as the workers' pools hold them
        bs = ph["params"]["block_tokens"]
        kv = got["config"]["phases"][ph["name"]]
        assert kv["block_size"] == bs
        assert kv["blocks_per_worker"] == h100.num_blocks * h100.block_size // bs
    # the reference phase is the simulation at the profile's own blocks, figure for figure
    rate = 2 * 4
    ref = simulate(ClusterConfig(colocated=4, routing=routing_profile("cache_aware", 0),
                                 itl_every=10), h100,
                   mooncake(str(trace), limit=24,
                            time_scale=trace_rate(str(trace), 24) / rate), "ref",
                   {"ttft": 2.0, "tpot": 0.08})
    assert phases[0]["summary"] == json.loads(json.dumps(ref.phase.summary))
    summary = got["summary"]
    assert summary["order"] == "16 / 32 / 64 / 128 / 256 / 512 tokens"
    for label in ("hit_rate", "ttft_p50", "tpot_p99", "goodput"):
        assert len(summary[f"{label} @ {rate:g} req/s"].split(" / ")) == 6
        moved = summary[f"{label} vs 16 @ {rate:g} req/s"].split(" / ")
        assert len(moved) == 5 and all(m == "-" or m.endswith(" %") for m in moved)
        chance = summary[f"{label} 16 reseeded @ {rate:g} req/s"].split(" / ")
        assert len(chance) == 2 and all(m == "-" or m.endswith(" %") for m in chance)
    assert summary[f"simulated req/s @ {rate:g} req/s"].split(" / ")[0].endswith("(1.00x)")
