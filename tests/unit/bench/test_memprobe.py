"""bench/memprobe.py: the machine's memory latency (sim bench's reference)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import memprobe


def test_loads_from_beyond_the_caches_wait_longer_than_from_within() -> None:
    """A region twice this box's L3 against one its L2 holds: the probe tells memory
    from cache (the interpreter's own step subtracted from both)."""
    got = memprobe.measure(region_mib=64, cache_mib=1, steps=200_000, repeats=3)
    assert got["region_mib"] == 64 and got["cache_mib"] == 1 and got["step_ns"] > 0
    assert got["load_ns"] > got["cache_load_ns"] + 20, got


def test_the_l3_as_the_machine_reports_it(tmp_path: Path) -> None:
    f = tmp_path / "size"
    for text, mib in (("32768K\n", 32), ("16M", 16), ("1G", 1024), ("512K", 1)):
        f.write_text(text)
        assert memprobe.l3_mib(str(f)) == mib
    f.write_text("lots")
    assert memprobe.l3_mib(str(f)) == 32  # unreadable: this box's
    assert memprobe.l3_mib(str(tmp_path / "missing")) == 32


def test_measured_apart_in_a_process_of_its_own() -> None:
    got = memprobe.measure_apart(region_mib=2, cache_mib=1, steps=20_000, repeats=1)
    assert got is not None and got["region_mib"] == 2 and got["cache_mib"] == 1
    assert got["step_ns"] > 0 and memprobe.describe(got).startswith("a dependent load")


@pytest.mark.parametrize("kwargs", [{"region_mib": 0}, {"cache_mib": 0}, {"steps": 0},
                                    {"repeats": 0}])
def test_refuses_empty_measures(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        memprobe.measure(**kwargs)


def test_cache_probe_samples_between_a_callers_steps() -> None:
    """A sample again and again (sim bench takes one at each tenth of its run); a step's
    time becomes a load's latency net of the interpreter's own step."""
    probe = memprobe.CacheProbe(cache_mib=1, steps=20_000)
    assert probe.cache_mib == 1 and probe.step > 0
    assert probe.ns(probe.step) == 0.0 and probe.ns(probe.step / 2) == 0.0
    assert probe.ns(probe.step + 150e-9) == 150.0
    samples = [probe.sample() for _ in range(3)]
    assert all(isinstance(x, float) and x >= 0 for x in samples)
    with pytest.raises(ValueError):
        memprobe.CacheProbe(cache_mib=0)
