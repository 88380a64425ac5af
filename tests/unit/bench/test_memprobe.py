"""bench/memprobe.py: the machine's memory latency (sim bench's reference)."""

from __future__ import annotations

import pytest

from bench import memprobe


def test_loads_from_beyond_the_caches_wait_longer_than_from_within() -> None:
    """A region twice this box's L3 against one its L2 holds: the probe tells memory
    from cache (the interpreter's own step subtracted from both)."""
    near = memprobe.measure(region_mib=1, steps=200_000, repeats=3)
    far = memprobe.measure(region_mib=64, steps=200_000, repeats=3)
    assert near["region_mib"] == 1 and far["region_mib"] == 64
    assert near["step_ns"] > 0 and far["step_ns"] > 0
    assert far["load_ns"] > near["load_ns"] + 20, (near, far)


def test_measured_apart_in_a_process_of_its_own() -> None:
    got = memprobe.measure_apart(region_mib=2, steps=20_000, repeats=1)
    assert got is not None and got["region_mib"] == 2 and got["step_ns"] > 0


@pytest.mark.parametrize("kwargs", [{"region_mib": 0}, {"steps": 0}, {"repeats": 0}])
def test_refuses_empty_measures(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        memprobe.measure(**kwargs)
