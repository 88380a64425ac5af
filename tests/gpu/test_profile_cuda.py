"""`splitserve bench profile --device cuda` (skipped without a GPU): workload c on the
Qwen3-0.6B shape and a cuda_ipc hand-off under torch.profiler; the device's kernels are
found and tied to the steps and hand-offs that launched them."""

from __future__ import annotations

import json

import pytest

from cluster.cli import main

pytestmark = pytest.mark.gpu


def test_profile_on_the_gpu(tmp_path):
    out = tmp_path / "profile.json"
    assert main(["bench", "profile", "--device", "cuda", "--model-shape", "qwen3-0.6b",
                 "--scale", "0.05", "--decode-steps", "3", "--mixed-steps", "2",
                 "--transports", "cuda_ipc", "--handoff-tokens", "512", "--handoffs", "2",
                 "--trace-dir", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for w in result["engine"]["windows"].values():
        assert w["kernel"] == "CUDA kernel"
        for s in w["steps"]:
            assert s["kernels"] > 0 and s["launch_calls"] > 0, s
            assert 0 < s["device_us"] and 0 <= s["host_us"] <= s["wall_us"], s
            assert 0 <= s["gap_max_us"] <= s["gap_sum_us"], s
    ipc = result["handoff"]["cuda_ipc"]["sender"]
    assert ipc["chunks"] == 4 and ipc["round_trips_per_chunk"] == 1
    assert ipc["notices_per_chunk"] == 1 and ipc["device_us"] > 0
    assert result["machine"]["gpu"].startswith("NVIDIA")
