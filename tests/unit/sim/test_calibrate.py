"""The calibration fit recovers known step costs, and a profile round-trips JSON."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from sim.calibrate import fit_roofline, fit_steps
from sim.latency import LatencyModel
from sim.profile import load_profile, save_profile


def test_fit_recovers_known_costs() -> None:
    a, b, c, d = 2e-3, 1e-4, 5e-12, 2e-11
    rows = [(a + b * s + c * f + d * m, s, f, m)
            for s, f, m in [(1, 1e9, 2e7), (8, 8e9, 3e7), (32, 3e10, 5e7), (1, 2e11, 4e7),
                            (4, 5e10, 9e7), (64, 6e10, 2e8), (2, 1e8, 1e7)]]
    (fa, fb, fc, fd), err = fit_steps(rows)
    assert err < 1e-6
    for got, want in ((fa, a), (fb, b), (fc, c), (fd, d)):
        assert got == pytest.approx(want, rel=1e-3)


def test_roofline_fit_recovers_known_costs() -> None:
    """Steps timed as a + b * seqs + max(c * flops, d * bytes): decode steps bound by
    bytes, prefill steps by FLOPs, some near the ridge."""
    a, b, c, d = 1e-4, 5e-5, 1.0 / 560e12, 1.0 / 3.0e12
    shapes = [(1, 2e10, 1.6e10), (8, 1.5e11, 1.62e10), (64, 1.1e12, 1.7e10),
              (256, 4.2e12, 2.5e10), (1, 1.3e14, 1.7e10), (32, 2.6e14, 2e10),
              (4, 8e12, 1.65e10), (128, 1e13, 3e10), (16, 3e13, 1.8e10)]
    rows = [(a + b * s + max(c * f, d * m), s, f, m) for s, f, m in shapes]
    (fa, fb, fc, fd), err, _ = fit_roofline(rows)
    assert err < 1e-6
    for got, want in ((fa, a), (fb, b), (fc, c), (fd, d)):
        assert got == pytest.approx(want, rel=1e-3, abs=1e-9)


def test_device_profile_from_bench_engine_json(tmp_path: Path) -> None:
    """A `bench engine --device cuda --json` file whose steps follow known efficiencies,
    plus one step 20x slow (a kernel compiling): the profile recovers the efficiencies
    against the file's measured peaks, drops the slow step, keeps --like's links."""
    import json

    from bench.engine_roofline import ModelCost
    from engine.config import ModelConfig
    from engine.model_shapes import model_shape_dir
    from sim.calibrate_gpu import device_profile

    peak, bw, ce, me, per_seq = 800e12, 4.0e12, 0.7, 0.75, 5e-5
    cost = ModelCost.from_config(ModelConfig.from_model_dir(model_shape_dir("llama3-8b")), 2)
    steps = []
    for tokens, sampled, pairs, kv in [(1, 1, 600, 600), (64, 64, 40000, 40000),
                                       (256, 256, 400000, 400000), (8192, 1, 33550336, 8192),
                                       (4096, 8, 2e6, 4096), (16384, 32, 4.2e6, 16384),
                                       (32, 32, 30000, 30000), (2048, 4, 600000, 2048)]:
        t = per_seq * sampled + max(cost.step_flops(tokens, sampled, int(pairs)) / (peak * ce),
                                    cost.step_bytes(kv) / (bw * me))
        steps.append([t, tokens, sampled, int(pairs), kv, int(tokens == sampled)])
    steps.append([20 * steps[1][0], *steps[1][1:]])
    data = {"config": {"model_shape": "llama3-8b", "dtype": "bfloat16", "torch": "x",
                       "engine": {"num_kv_blocks": 5000, "block_size": 16, "max_num_seqs": 256,
                                  "max_num_batched_tokens": 16384,
                                  "attention_backend": "triton", "cuda_graphs": True}},
            "limits": {"device": "GPU", "matmul_flop_s": peak, "bandwidth_bytes_s": bw},
            "workloads": {"x": {"ours": {"steps": steps}}}}
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(data))
    like = load_profile("h100")
    prof, notes = device_profile("gpu", [str(path)], like)
    assert prof.fit["outliers_dropped"] == 1 and prof.fit["relative_rms_error"] < 1e-6
    assert prof.compute_efficiency == pytest.approx(ce, rel=1e-3)
    assert prof.memory_efficiency == pytest.approx(me, rel=1e-3)
    assert prof.seq_overhead_s == pytest.approx(per_seq, rel=1e-3)
    assert (prof.peak_flop_s, prof.bandwidth_bytes_s, prof.num_blocks) == (peak, bw, 5000)
    assert prof.combine == "max" and prof.links == like.links
    assert "1 steps over" in notes[0]


def test_checked_in_profiles_load_and_time_steps(tmp_path: Path) -> None:
    for name in ("cpu", "h100", "h200"):
        prof = load_profile(name)
        lat = LatencyModel(prof)
        decode = lat.seconds(1, 1, 1000, 1000, 1)
        prefill = lat.seconds(2048, 1, 2048 * 2049 // 2, 2048, 1)
        assert 0 < decode < prefill
        save_profile(prof, str(tmp_path / f"{name}.json"), ["note"])
        assert load_profile(str(tmp_path / f"{name}.json")) == prof
    h100 = load_profile("h100")
    assert "bench engine --device cuda" in h100.source  # fitted, not typed in
    # llama3-8b on an H100 at batch 1: ~16 GB of weights per decode step.
    assert 0.004 < LatencyModel(h100).seconds(1, 1, 100, 100, 1) < 0.02
    with pytest.raises(ValueError):
        replace(h100, combine="min")


def test_serving_fit_recovers_the_machines_speed_and_request_overhead() -> None:
    """Requests timed on a machine 1.3x slower than the profile with 5 ms per request:
    the speed comes from the TPOTs, the overhead from what TTFT leaves at that speed."""
    from types import SimpleNamespace

    from sim.calibrate import serving_overheads
    from sim.profile import at_speed

    cpu = load_profile("cpu")
    slow = LatencyModel(at_speed(cpu, 1.3))
    results = [SimpleNamespace(ok=True, prompt_len=p,
                               ttft_s=0.005 + slow.seconds(p, 1, p * (p + 1) // 2, p, 1),
                               tpot_s=slow.seconds(1, 1, p + 8, p + 8, 1))
               for p in (32, 90, 200, 311, 480)]
    results.append(SimpleNamespace(ok=False, prompt_len=64, ttft_s=None, tpot_s=None))
    fit = serving_overheads(cpu, results, fit_speed=True)
    assert fit["speed"] == pytest.approx(1.3, rel=1e-6)
    assert fit["request_overhead_s"] == pytest.approx(0.005, rel=1e-6)
    assert fit["token_overhead_s"] == cpu.token_overhead_s
    # Without the speed fit the slowness is read as overheads instead.
    plain = serving_overheads(cpu, results)
    assert plain["speed"] == 1.0 and plain["request_overhead_s"] > 0.01
    assert LatencyModel(at_speed(cpu, 2.0)).seconds(100, 1, 5050, 100, 1) == pytest.approx(
        2 * LatencyModel(cpu).seconds(100, 1, 5050, 100, 1))


def test_serving_fit_recovers_prefill_and_decode_speeds_apart() -> None:
    """Decode steps 1.4x slower than the profile, prefills' FLOPs 0.9x, 12 ms per
    request: the TPOTs give the first, the TTFTs' line against the prefills' FLOP time
    the second (its slope) and the overhead (its intercept). One factor from the TPOTs
    alone would have overstated every prefill and left too small an overhead."""
    from types import SimpleNamespace

    from sim.calibrate import serving_overheads
    from sim.profile import at_speed

    cpu = load_profile("cpu")
    real = LatencyModel(at_speed(cpu, 1.4, 0.9))
    results = [SimpleNamespace(ok=True, prompt_len=p,
                               ttft_s=0.012 + real.seconds(p, 1, p * (p + 1) // 2, p, 1),
                               tpot_s=real.seconds(1, 1, p + 8, p + 8, 1))
               for p in (32, 90, 200, 311, 480)]
    fit = serving_overheads(cpu, results, fit_speed=True)
    # the decode step's few FLOPs run at 0.9x too: the TPOT factor is a hair under 1.4
    assert fit["speed"] == pytest.approx(1.4, rel=0.01)
    assert fit["compute_speed"] == pytest.approx(0.9, rel=0.02)
    assert fit["request_overhead_s"] == pytest.approx(0.012, rel=0.05)
    fitted = LatencyModel(at_speed(cpu, fit["speed"], fit["compute_speed"]))
    for p in (32, 480):
        assert fitted.seconds(p, 1, p * (p + 1) // 2, p, 1) + fit["request_overhead_s"] \
            == pytest.approx(real.seconds(p, 1, p * (p + 1) // 2, p, 1) + 0.012, rel=0.01)
    # one factor, from the TPOTs alone, misreads the same requests
    single = LatencyModel(at_speed(cpu, fit["speed"]))
    assert single.seconds(480, 1, 480 * 481 // 2, 480, 1) > \
        1.2 * real.seconds(480, 1, 480 * 481 // 2, 480, 1)


def test_serving_fit_keeps_one_factor_where_the_prefills_set_no_line() -> None:
    """Every prompt of one length: the TTFTs fix no slope, so the FLOPs keep the TPOTs'
    factor and the overhead is the median as before."""
    from types import SimpleNamespace

    from sim.calibrate import serving_overheads
    from sim.profile import at_speed

    cpu = load_profile("cpu")
    slow = LatencyModel(at_speed(cpu, 1.3))
    results = [SimpleNamespace(ok=True, prompt_len=200,
                               ttft_s=0.005 + slow.seconds(200, 1, 20100, 200, 1),
                               tpot_s=slow.seconds(1, 1, 208, 208, 1)) for _ in range(4)]
    fit = serving_overheads(cpu, results, fit_speed=True)
    assert fit["compute_speed"] == fit["speed"] == pytest.approx(1.3, rel=1e-6)
    assert fit["request_overhead_s"] == pytest.approx(0.005, rel=1e-6)


def test_at_speed_slows_the_flops_by_their_own_factor() -> None:
    from sim.profile import at_speed

    cpu = load_profile("cpu")
    base = LatencyModel(cpu)
    c, m = base.parts(300, 1, 300 * 301 // 2, 300, 1)
    assert c + m == pytest.approx(base.seconds(300, 1, 300 * 301 // 2, 300, 1))
    both = LatencyModel(at_speed(cpu, 1.5, 0.8))
    assert both.seconds(300, 1, 300 * 301 // 2, 300, 1) == pytest.approx(0.8 * c + 1.5 * m)
    with pytest.raises(ValueError):
        at_speed(cpu, 1.0, 0.0)
