"""The simulator against a real GPU (skipped without one): one colocated worker serving
llama3-8b (dummy weights, bf16) with the engine settings its profile was fitted at
(sim/profiles/h100.json or h200.json, by the card's name) replays a Mooncake sample;
the simulator replays the same requests at the same arrival times on that profile as
checked in. TTFT and TPOT p50 within 15 % and the hit rate within 2 points, as the CPU
validation (tests/integration/test_sim_validation.py) asks of the CPU profile.

No speed is fitted here (the GPU profile is the calibration under test); the serving
overheads per request and per token, which `bench engine` cannot measure, are measured
on this cluster as `sim calibrate` does (requests one at a time, before and after the
replay) and reported beside the profile's assumed ones. A warm pass over the same
prompts (another cache salt) first, so that Triton's first-use compiles (~0.5 s each)
fall outside the replay. The client asks for each token's logprob (`token_chunks`):
dummy weights sample ids the embedded tokenizer (687 tokens) mostly has no text for,
and a token without text makes no stream chunk otherwise, so TTFT would be the first
printable token's time and TPOT the gaps between the few that are. Every figure is
printed; with SIM_VALIDATION_OUT set, the report and the real phases
(every request) are written there as JSON: `splitserve sim calibrate --serving-json`
fits a GPU profile's serving overheads from such a file.

The sample (tests/gpu/data/mooncake-sample.jsonl): the first 80 records of every 10th
conversation of the Mooncake conversation trace (all its turns), each 512-token block
as 128 tokens (prompts 200-7,000, p50 ~2,100), outputs at most 32 tokens, arrivals at
0.06x the trace's (80 requests in ~15 s).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.datasets import TokenPool, mooncake
from bench.experiments.common import ExperimentConfig, measure, start_cluster
from bench.load import LoadSpec
from bench.routing_bench import SaltedClient
from bench.runner import Phase, run_phase
from sim.calibrate import serving_overheads, serving_requests
from sim.config import ClusterConfig
from sim.profile import HardwareProfile, load_profile
from sim.run_cli import simulate
from sim.workload import from_bench
from tests.integration.test_sim_validation import compare

pytestmark = pytest.mark.gpu

SAMPLE = Path(__file__).parent / "data" / "mooncake-sample.jsonl"
BLOCK_TOKENS, TIME_SCALE, MAX_INPUT, MAX_OUTPUT = 128, 0.06, 7000, 32


def gpu_profile() -> HardwareProfile:
    name = torch.cuda.get_device_name()
    for key in ("H200", "H100"):
        if key in name:
            return load_profile(key.lower())
    pytest.skip(f"no simulator profile for {name}")


def simulated(prof: HardwareProfile, specs: list[Any], one: list[Any]
              ) -> tuple[dict[str, Any], dict[str, float]]:
    """The replay simulated on `prof` with the serving overheads measured from `one`,
    and those overheads."""
    fitted = serving_overheads(prof, one)
    prof = replace(prof, request_overhead_s=fitted["request_overhead_s"],
                   token_overhead_s=fitted["token_overhead_s"])
    run = simulate(ClusterConfig(colocated=1, max_in_flight=256), prof, specs, "sim")
    return run.phase.summary, fitted


def replay_requests(prof: HardwareProfile) -> list[Any]:
    """The sample as the replay sends it (the same token ids on every machine)."""
    from engine.model_shapes import model_shape_dir

    pool = TokenPool.from_tokenizer_dir(model_shape_dir(prof.model_shape), 0)
    return mooncake(str(SAMPLE), pool, block_tokens=BLOCK_TOKENS, time_scale=TIME_SCALE,
                    max_input_len=MAX_INPUT, max_output_len=MAX_OUTPUT)


@pytest.mark.timeout(600)
def test_simulator_matches_a_real_gpu_worker(tmp_path: Path) -> None:
    from engine.model_shapes import model_shape_dir

    prof = gpu_profile()
    worker_args = ("--device", "cuda", "--dtype", prof.dtype, "--load-format", "dummy",
                   "--max-model-len", "8192")
    off, report = validate(prof, model_shape_dir(prof.model_shape), worker_args,
                           replay_requests(prof), tmp_path, torch.cuda.get_device_name())
    print("\n".join(report))
    assert not off, "simulator off against the GPU:\n" + "\n".join(report)


def validate(prof: HardwareProfile, model_dir: str, worker_args: tuple[str, ...],
             reqs: list[Any], tmp_path: Path, device: str) -> tuple[list[str], list[str]]:
    """Runs the replay on one real colocated worker (`worker_args` plus the profile's
    engine settings) and on the simulator; (figures off tolerance, report lines)."""
    sequential = serving_requests(model_dir, 16, seed=1)
    cfg = ExperimentConfig(model_dir, str(tmp_path), progress=False)
    worker_args = (*worker_args, "--block-size", str(prof.block_size),
                   "--max-num-seqs", str(prof.max_num_seqs),
                   "--max-num-batched-tokens", str(prof.max_num_batched_tokens))
    phases: dict[str, Phase] = {}

    async def body(_: Any) -> list[Phase]:
        client = SaltedClient(url, "", 120.0, token_chunks=True)
        try:
            for name, batch, load in (
                    ("warm", reqs, LoadSpec("concurrency", concurrency=16)),
                    ("before", sequential, LoadSpec("concurrency", concurrency=1)),
                    ("trace", reqs, LoadSpec("trace")),
                    ("after", sequential, LoadSpec("concurrency", concurrency=1))):
                client.salt = f"sim-validation-gpu-{name}"
                phases[name] = await run_phase(client, batch, load, name=name,
                                               progress=False)
                assert phases[name].summary["failed"] == 0, phases[name].summary["errors"]
        finally:
            await client.close()
        return []

    with start_cluster(cfg, colocated=1, worker_args=worker_args) as cluster:
        url = cluster.url
        measure(cfg, cluster, body)
    off, report = compare_phases(prof, reqs, phases, device)
    if out := os.environ.get("SIM_VALIDATION_OUT"):
        with open(os.path.join(out, f"sim-validation-{prof.name}.json"), "w") as f:
            json.dump({"device": device, "profile": prof.name, "report": report,
                       "phases": {k: p.to_json() for k, p in phases.items()}}, f, indent=1)
    return off, report


def compare_phases(prof: HardwareProfile, reqs: list[Any], phases: dict[str, Phase],
                   device: str) -> tuple[list[str], list[str]]:
    """The replay's real figures against the simulator's, on the profile as checked in
    and with the serving overheads measured from the sequential phases."""
    real = phases["trace"].summary
    one = phases["before"].results + phases["after"].results
    specs = list(from_bench(reqs, LoadSpec("trace")))
    as_is = simulate(ClusterConfig(colocated=1, max_in_flight=256), prof, specs,
                     "sim").phase.summary
    sim, fitted = simulated(prof, specs, one)
    _, lines_as_is = compare(real, as_is, {**fitted, "speed": 1.0, "request_overhead_s":
                                           prof.request_overhead_s,
                                           "token_overhead_s": prof.token_overhead_s})
    off, lines = compare(real, sim, {**fitted, "speed": 1.0})
    return off, [f"{device}, profile {prof.name}:",
                 "the profile as checked in:", *("  " + ln for ln in lines_as_is),
                 "with the serving overheads measured here:", *("  " + ln for ln in lines)]
