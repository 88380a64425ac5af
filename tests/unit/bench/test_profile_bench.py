"""`splitserve bench profile`: the real engine (tiny random Llama) and real hand-offs
between two processes under torch.profiler; the summaries hold what a reader relies on
(launches counted, host time within the wall, gaps not negative, every chunk and
round trip that went over the wire counted)."""

from __future__ import annotations

import json

import pytest

from bench import profile_trace as pt
from bench.profile_bench import resolve_defaults
from bench.profile_engine import PHASE_RANGES
from bench.profile_handoff import profile_handoffs
from bench.transfer_handoff import LAYOUTS
from cluster.cli import build_parser, main
from kvtransfer import KVLayout


@pytest.mark.parametrize("scheduling", ["--no-async-scheduling", "--async-scheduling"])
def test_engine_windows_have_sane_figures(tmp_path, capsys, scheduling):
    # (async: no synchronize per step; each step's range reads the step launched before)
    out = tmp_path / "profile.json"
    assert main(["bench", "profile", "--device", "cpu", "--parts", "engine", "--scale", "0.05",
                 "--decode-steps", "3", "--mixed-steps", "2", "--max-num-batched-tokens",
                 "128", "--trace-dir", str(tmp_path / "traces"), "--json", str(out),
                 scheduling]) == 0
    result = json.loads(out.read_text())
    windows = result["engine"]["windows"]
    assert set(windows) == {"mixed", "decode"}
    assert windows["decode"]["kinds"]["decode"] == 3
    assert windows["mixed"]["kinds"]["mixed"] >= 1  # prefills still running beside decodes
    for name, w in windows.items():
        assert len(w["steps"]) == w["summary"]["steps"]
        for s in w["steps"]:
            assert s["kernels"] > 0 and s["launch_calls"] > 0, (name, s)
            assert 0 <= s["host_us"] <= s["wall_us"], (name, s)
            assert 0 < s["device_us"] <= s["wall_us"], (name, s)
            assert 0 <= s["gap_max_us"] <= s["gap_sum_us"] <= s["wall_us"], (name, s)
            assert set(s["phases_us"]) == set(PHASE_RANGES)
            assert sum(s["phases_us"].values()) <= s["wall_us"]
            assert s["phases_us"]["engine.schedule"] > 0 and s["phases_us"]["engine.forward"] > 0
        events = pt.load(w["trace"])
        assert len(pt.ranges(events, "engine.step")) == len(w["steps"])
        # the kernels by time: a share of the steps' device time, the largest first
        top = w["top_kernels"]
        times = [k["us_per_step"] for k in top]
        assert top and times == sorted(times, reverse=True)
        assert sum(times) <= sum(s["device_us"] for s in w["steps"]) / len(w["steps"]) + 1
        assert all(k["per_step"] > 0 and k["name"].startswith("aten::") for k in top)
    assert result["summary"]["decode_kernels"] > 0
    text = capsys.readouterr().out
    assert "top-level aten op (CPU)" in text and "decode" in text


def test_handoffs_over_tcp_and_shm_count_what_was_sent(tmp_path):
    layout = KVLayout(**LAYOUTS["small"])
    tokens, chunks, repeats = 256, 4, 2
    rows = profile_handoffs(["tcp", "shm"], "cpu", layout, tokens, chunks, repeats,
                            str(tmp_path))
    blocks = tokens // layout.block_size
    for transport, row in rows.items():
        s = row["sender"]
        assert s["handoffs"] == repeats and s["chunks"] == chunks, transport
        assert s["bytes"] == blocks * layout.block_bytes and s["gbps"] > 0
        assert 0 < s["copy_us"] <= s["wall_us"]
        assert s["fixed_us"] == pytest.approx(s["wall_us"] - s["copy_us"])
        # one verdict awaited per hand-off: asked for over tcp, sent unasked to the
        # writer in place
        assert s["frames"]["FINISH"] == 0  # every writer is sent its verdict unasked
        assert s["finish_wait_us"] > 0
    tcp, shm = rows["tcp"]["sender"], rows["shm"]["sender"]
    # tcp streams its regions: no reply awaited inside a chunk, the verdict at the end;
    # a chunk's regions (one per block: scattered) go as one frame
    assert tcp["round_trips_per_chunk"] == 0 and tcp["notices_per_chunk"] == 0
    assert tcp["round_trips"] == 1
    assert tcp["frames"]["WRITE"] == chunks and shm["frames"]["WRITE"] == 0
    # shm writes in place under the transfer's grant, asked for once before the first
    # chunk: no round trip in a chunk, one WRITTEN notice each, the verdict at the end
    assert shm["round_trips_per_chunk"] == 0 and shm["notices_per_chunk"] == 1
    assert shm["frames"]["RESERVE"] == 0 and shm["round_trips"] == 1
    assert shm["grant_us"] > 0
    rx_tcp, rx_shm = rows["tcp"]["receiver"], rows["shm"]["receiver"]
    assert rx_tcp["rx.write"]["calls"] == chunks  # a frame per chunk, a row per block
    assert rx_tcp["rx.reserve"]["calls"] == 0
    assert rx_shm["rx.reserve"]["calls"] == 1 and rx_shm["rx.written"]["calls"] == chunks
    assert rx_shm["rx.write"]["calls"] == 0


def test_cli_parses_and_fills_device_defaults():
    argv = ["bench", "profile", "--device", "cpu", "--parts", "handoff",
            "--handoff-chunks", "2", "--transports", "tcp"]
    args = build_parser(argv).parse_args(argv)
    resolve_defaults(args)
    assert args.parts == ["handoff"] and args.layout == "small"
    assert args.handoff_tokens == 2048 and args.scale == 0.125
    argv = ["bench", "profile", "--device", "cuda", "--parts", "engine"]
    args = build_parser(argv).parse_args(argv)
    resolve_defaults(args)
    assert args.model_shape == "llama3-8b" and args.transports == "cuda_ipc,ucx"
    assert args.max_num_batched_tokens is None and args.decode_steps == 20
    argv = ["bench", "profile", "--parts", "gpu"]
    with pytest.raises(SystemExit):
        resolve_defaults(build_parser(argv).parse_args(argv))


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1,
            "args": args}


def test_cuda_kernels_belong_to_the_step_that_launched_them():
    # A CUDA trace's shape: kernels on the device (pid 0), tied to their launch calls by
    # correlation; the second step's first kernel runs after that step's range ended.
    step1, step2 = _x("user_annotation", "engine.step", 0, 100), \
        _x("user_annotation", "engine.step", 200, 100)
    events = [step1, step2,
              _x("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
              _x("cuda_driver", "cuLaunchKernelEx", 20, 5, correlation=2),
              _x("cuda_runtime", "cudaStreamSynchronize", 30, 60),
              _x("cuda_runtime", "cudaGraphLaunch", 210, 5, correlation=3),
              {**_x("kernel", "gemm", 40, 20, correlation=1), "pid": 0},
              {**_x("kernel", "attn", 70, 10, correlation=2), "pid": 0},
              {**_x("kernel", "graph_a", 290, 30, correlation=3), "pid": 0},
              {**_x("kernel", "graph_b", 330, 10, correlation=3), "pid": 0}]
    work = pt.DeviceWork(events)
    assert work.cuda
    a = pt.step_figures(events, step1, work, ())
    assert a["kernels"] == 2 and a["launch_calls"] == 2
    assert a["device_us"] == 30 and a["gap_sum_us"] == 10 and a["gap_max_us"] == 10
    assert a["host_us"] == 40  # 100 of wall less 60 waiting on the device
    b = pt.step_figures(events, step2, work, ())
    assert b["kernels"] == 2 and b["launch_calls"] == 1 and b["device_us"] == 40
    assert b["gap_max_us"] == 10 and b["host_us"] == 100


def test_phase_ranges_count_their_own_time_only():
    def rng(name, ts, dur):
        return {"cat": "user_annotation", "name": name, "ts": ts, "dur": dur}

    # an async step's resolve (update) holds the read of its tokens and its outputs
    events = [rng("engine.schedule", 0, 10), rng("engine.update", 20, 100),
              rng("engine.sample", 30, 40), rng("engine.outputs", 80, 30),
              rng("engine.inputs", 130, 5), rng("engine.inputs", 132, 2)]
    got = pt.exclusive_phases(events, ["engine.schedule", "engine.update", "engine.sample",
                                       "engine.outputs", "engine.inputs"])
    assert got == {"engine.schedule": 10, "engine.update": 30, "engine.sample": 40,
                   "engine.outputs": 30, "engine.inputs": 5}
