"""The calibration fit recovers known step costs, and a profile round-trips JSON."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from sim.calibrate import fit_steps
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


def test_checked_in_profiles_load_and_time_steps(tmp_path: Path) -> None:
    for name in ("cpu", "h100"):
        prof = load_profile(name)
        lat = LatencyModel(prof)
        decode = lat.seconds(1, 1, 1000, 1000, 1)
        prefill = lat.seconds(2048, 1, 2048 * 2049 // 2, 2048, 1)
        assert 0 < decode < prefill
        save_profile(prof, str(tmp_path / f"{name}.json"), ["note"])
        assert load_profile(str(tmp_path / f"{name}.json")) == prof
    h100 = load_profile("h100")
    assert "not measured" in h100.source
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
