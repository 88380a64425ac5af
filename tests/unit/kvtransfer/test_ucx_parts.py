"""How the ucx transport cuts a region into per-lane parts (same rule on both sides)."""

from __future__ import annotations

import pytest

from kvtransfer.ucx_puts import _ALIGN, _SPLIT_MIN, _parts


@pytest.mark.parametrize("nbytes", [1, 4096, _SPLIT_MIN - 1])
def test_small_regions_travel_whole(nbytes: int) -> None:
    assert _parts(nbytes, 2) == [(0, nbytes)]


@pytest.mark.parametrize("lanes", [1, 2, 3, 8])
@pytest.mark.parametrize("nbytes", [_SPLIT_MIN, 1_231_872, 64 << 20, (64 << 20) + 3])
def test_parts_tile_the_region_page_aligned(lanes: int, nbytes: int) -> None:
    parts = _parts(nbytes, lanes)
    assert 1 <= len(parts) <= lanes
    assert parts[0][0] == 0 and sum(n for _, n in parts) == nbytes
    for (off, n), (nxt, _) in zip(parts, parts[1:], strict=False):
        assert off + n == nxt and nxt % _ALIGN == 0 and n > 0
    if lanes > 1:
        assert len(parts) == lanes  # every lane gets work at these sizes
        sizes = [n for _, n in parts]
        assert max(sizes) - min(sizes) <= lanes * _ALIGN


def test_plan_lanes_splits_large_and_balances_small() -> None:
    from kvtransfer.ucx_puts import plan_lanes

    big = 4 * _SPLIT_MIN
    items = [(0, big, 10 * big)] + [(big + i * 4096, 4096, i * 8192) for i in range(6)]
    plan = plan_lanes(items, 2)
    assert [sum(n for _, n, _ in lane) for lane in plan] == [big // 2 + 3 * 4096] * 2
    # Every byte once, each part at the same offset on both sides.
    moved = sorted((loc, n, rem) for lane in plan for loc, n, rem in lane)
    assert sum(n for _, n, _ in moved) == sum(n for _, n, _ in items)
    assert moved[0] == (0, big // 2, 10 * big) and moved[1] == (big // 2, big // 2,
                                                                10 * big + big // 2)
