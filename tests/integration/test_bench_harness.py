"""The experiment harness end to end on a tiny model: `bench experiment disagg --quick`
starts both configurations and writes JSON, Markdown and PNG; `bench run` measures a
running cluster over OpenAI HTTP (rate sweep, SLO goodput, cached tokens) and gRPC."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main as splitserve
from cluster.launcher import ClusterSpec, LocalCluster
from tests.factories import tiny_model_dir
from tests.integration.serving_util import splitserve_cli

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(150)
def test_disagg_experiment_quick(tmp_path: Path) -> None:
    out = tmp_path / "out"
    splitserve_cli("bench", "experiment", "disagg", "--quick", "--model",
                   tiny_model_dir("llama"), "--out-dir", str(out), "--json",
                   str(tmp_path / "d.json"), "--no-progress", timeout=140)
    data = json.loads((tmp_path / "d.json").read_text())
    s = data["summary"]
    for key in ("tpot_p99_colocated", "tpot_p99_disagg", "tpot_p99_unloaded",
                "ttft_p50_colocated", "ttft_p50_disagg"):
        assert isinstance(s[key], float) and s[key] > 0, key
    assert s["failed_requests"] == 0
    assert s["remote_prefills"] == 3  # the quick workload's three long prompts, all remote
    assert [p["name"] for p in data["phases"]] == ["unloaded", "colocated", "disagg"]
    assert {p["summary"]["completed"] for p in data["phases"]} == {4, 7}
    md = (out / "disagg.md").read_text()
    assert "`tpot_p99_disagg`" in md and "| disagg |" in md
    for name in ("disagg-latency-cdf.png", "disagg-compare.png"):
        blob = (out / name).read_bytes()
        assert blob.startswith(PNG) and len(blob) > 10_000
        assert f"({name})" in md


@pytest.mark.timeout(150)
def test_bench_run_http_sweep_and_grpc(tmp_path: Path) -> None:
    model = tiny_model_dir("llama")
    with LocalCluster(ClusterSpec(model, num_colocated=1, worker_args=(
            "--num-blocks", "256", "--max-model-len", "512"))) as cluster:
        http = ["bench", "run", "--url", f"http://127.0.0.1:{cluster.http_port}",
                "--tokenizer", model, "--dataset", "shared-prefix", "--num-groups", "2",
                "--num-prompts", "6", "--prefix-len", "64", "--input-len", "8",
                "--output-len", "5", "--load", "poisson", "--rates", "20,40",
                "--slo", "ttft=30,tpot=10", "--out-dir", str(tmp_path / "http"),
                "--name", "sweep", "--json", str(tmp_path / "http.json"), "--no-progress"]
        assert splitserve(http) == 0
        grpc = ["bench", "run", "--url", f"127.0.0.1:{cluster.grpc_port}", "--backend", "grpc",
                "--tokenizer", model, "--dataset", "multi-turn", "--num-prompts", "6",
                "--turns", "3", "--input-len", "12", "--output-len", "3", "--concurrency", "2",
                "--out-dir", str(tmp_path / "grpc"), "--json", str(tmp_path / "grpc.json"),
                "--no-progress"]
        assert splitserve(grpc) == 0
        # --token-chunks: the gateway takes `logprobs: 0` and streams a chunk per token
        chunks = ["bench", "run", "--url", f"http://127.0.0.1:{cluster.http_port}",
                  "--tokenizer", model, "--dataset", "synthetic", "--num-prompts", "4",
                  "--input-len", "16", "--output-len", "6", "--concurrency", "2",
                  "--token-chunks", "--out-dir", str(tmp_path / "chunks"), "--json",
                  str(tmp_path / "chunks.json"), "--no-progress"]
        assert splitserve(chunks) == 0
    c = json.loads((tmp_path / "chunks.json").read_text())["phases"][0]
    assert (c["summary"]["completed"], c["summary"]["total_output_tokens"]) == (4, 24)
    assert all(r["e2e_s"] > r["ttft_s"] > 0 for r in c["requests"])
    sweep = json.loads((tmp_path / "http.json").read_text())
    assert [p["params"]["rate"] for p in sweep["phases"]] == [20.0, 40.0]
    for p in sweep["phases"]:
        s = p["summary"]
        assert (s["completed"], s["failed"], s["total_output_tokens"]) == (6, 0, 30)
        assert s["good_requests"] == 6 and s["ttft_s"]["p50"] > 0 and s["itl_s"]["p50"] > 0
    # The second phase resends the same prompts: the server's prefix cache answers
    # for their full blocks, and the client reads it from the usage chunk.
    assert sweep["phases"][1]["summary"]["cached_tokens"] >= 6 * 64
    assert sorted(sweep["plots"]) == ["sweep-compare.png", "sweep-latency-cdf.png",
                                      "sweep-rate.png"]
    assert (tmp_path / "http" / "sweep-rate.png").read_bytes().startswith(PNG)
    g = json.loads((tmp_path / "grpc.json").read_text())["phases"][0]["summary"]
    assert (g["completed"], g["total_output_tokens"]) == (6, 18)
    # multi-turn: turns 2 and 3 carry the earlier turns as a prefix (12 + 3 tokens, 27 + 3)
    assert g["total_input_tokens"] == 2 * (12 + 27 + 42)
