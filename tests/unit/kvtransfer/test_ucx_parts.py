"""What a ucx write puts where (`kvtransfer/ucx_puts.py`): the rows of (local address,
nbytes, remote address) of its regions, carried out here as plain copies, land each
destination rank's heads; a region is cut into per-lane parts by the same rule on
both sides."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvtransfer import KVLayout, Region
from kvtransfer.layout import head_map, rank_pairs
from kvtransfer.memory import RankCaches, RegisteredKV
from kvtransfer.ucx_puts import _ALIGN, _SPLIT_MIN, _parts, put_rows

LAYOUT = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, block_size=4, dtype="float32")
SRC, DST = [3, 4, 5, 9], [10, 2, 3, 7]


def _ranks(full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    return [full[..., a:b, :].contiguous() for a, b in head_map(full.shape[4], tp)]


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2)])
def test_put_rows_land_each_ranks_heads(src_tp: int, dst_tp: int) -> None:
    """Whole byte ranges between equal TP sizes, per-token head runs between others:
    copied as the puts would be, every destination rank holds exactly its heads of the
    source blocks under the destination ids, and nothing else changed."""
    full = torch.randn(LAYOUT.tensor_shape(12), generator=torch.Generator().manual_seed(3))
    src = _ranks(full, src_tp)
    kv = RegisteredKV(RankCaches(src) if src_tp > 1 else src[0], LAYOUT)
    dst = [torch.zeros_like(t) for t in _ranks(full, dst_tp)]
    pairs = rank_pairs([(Region(s), Region(d)) for s, d in zip(SRC, DST, strict=True)],
                       LAYOUT.num_kv_heads, src_tp, dst_tp)
    bases = [t.data_ptr() for t in dst]
    groups = put_rows(kv, pairs, bases, dst[0].numel() * 4)
    assert set(groups) <= {(s, d) for s in range(src_tp) for d in range(dst_tp)}
    for (s_rank, d_rank), rows in groups.items():
        for local, n, remote in rows.tolist():
            src_base = src[s_rank].data_ptr()
            assert src_base <= local and local + n <= src_base + src[s_rank].numel() * 4
            assert bases[d_rank] <= remote and remote + n <= bases[d_rank] + dst[0].numel() * 4
            ctypes.memmove(remote, local, n)
    want = torch.zeros_like(full)
    want[DST] = full[SRC]
    for got, expected in zip(dst, _ranks(want, dst_tp), strict=True):
        assert torch.equal(got, expected)
    if src_tp == dst_tp:  # whole blocks both sides: one byte range a region, no runs
        assert sum(len(rows) for rows in groups.values()) == len(SRC) * src_tp


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
