"""`kvtransfer.memory.byte_runs`: the byte runs ucx puts between tensor-parallel ranks,
computed with numpy over the index grid, against the per-token definition (one run per
(block, layer, K/V, token), itertools over the index grid), for the head slices
`rank_pairs` makes between TP sizes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvtransfer.layout import KVLayout, Region, rank_layout, rank_pairs
from kvtransfer.memory import byte_runs, region_view

NUM_BLOCKS = 12


def _per_token(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int]]:
    """The definition: one run of heads x head_dim per index of the leading dims."""
    size = src.element_size()
    if src.is_contiguous() and dst.is_contiguous():
        return [(src.storage_offset() * size, dst.storage_offset() * size,
                 src.numel() * size)]
    run = src.shape[-1] * src.shape[-2] * size
    out = []
    for idx in itertools.product(*(range(n) for n in src.shape[:-2])):
        s = src.storage_offset() + sum(i * st for i, st in zip(idx, src.stride(), strict=False))
        d = dst.storage_offset() + sum(i * st for i, st in zip(idx, dst.stride(), strict=False))
        out.append((s * size, d * size, run))
    return out


def _split(runs: np.ndarray, unit: int) -> list[tuple[int, int, int]]:
    """Merged runs cut back into runs of `unit` bytes."""
    return [(s + k, d + k, unit) for s, d, n in runs.tolist() for k in range(0, n, unit)]


def _cases(layout: KVLayout, p: int, d: int, pairs: list[tuple[Region, Region]],
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    src_layout, dst_layout = rank_layout(layout, p), rank_layout(layout, d)
    src = torch.empty(src_layout.tensor_shape(NUM_BLOCKS))
    dst = torch.empty(dst_layout.tensor_shape(NUM_BLOCKS), device="meta")
    return [(region_view(src, s, src_layout), region_view(dst, t, dst_layout))
            for s, t in rank_pairs(pairs, layout.num_kv_heads, p, d)]


LAYOUTS = [KVLayout(num_layers=3, num_kv_heads=8, head_dim=4, block_size=4, dtype="float32"),
           KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, block_size=16, dtype="bfloat16"),
           KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=2, dtype="float16")]
PAIRS = [[(Region(3), Region(7)), (Region(4, num_blocks=2), Region(0, num_blocks=2))],
         [(Region(5, layer_start=1, layer_end=2), Region(9, layer_start=1, layer_end=2))]]


@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1), (2, 4), (4, 2), (2, 2), (1, 4)])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"h{x.num_kv_heads}")
@pytest.mark.parametrize("pairs", PAIRS, ids=["blocks", "one-layer"])
def test_runs_match_the_per_token_definition(layout: KVLayout, p: int, d: int,
                                             pairs: list[tuple[Region, Region]]) -> None:
    if max(p, d) > 2 * layout.num_kv_heads or layout.num_kv_heads % min(p, d):
        pytest.skip("TP sizes do not fit the head count")
    for src, dst in _cases(layout, p, d, pairs):
        want = _per_token(src, dst)
        runs = byte_runs(src, dst)
        assert runs.dtype == np.int64 and runs.shape[1] == 3
        assert _split(runs, want[0][2]) == want
        # merged: no two neighbouring rows are contiguous on both sides
        s, t, n = runs[:, 0], runs[:, 1], runs[:, 2]
        assert not np.any((s[1:] == s[:-1] + n[:-1]) & (t[1:] == t[:-1] + n[:-1]))


def test_slices_copied_by_their_runs_land_in_place() -> None:
    layout = LAYOUTS[0]
    full = torch.randn(layout.tensor_shape(NUM_BLOCKS))
    src = [full[..., :4, :].contiguous(), full[..., 4:, :].contiguous()]  # TP 2
    got = torch.zeros_like(full)  # TP 1
    pairs = rank_pairs([(Region(2, num_blocks=3), Region(6, num_blocks=3))], 8, 2, 1)
    out = got.view(-1).view(torch.uint8).numpy()
    for s, t in pairs:
        there = region_view(got, t, layout)
        data = src[s.rank].view(-1).view(torch.uint8).numpy()
        for a, b, n in byte_runs(region_view(src[s.rank], s, rank_layout(layout, 2)),
                                 there).tolist():
            out[b:b + n] = data[a:a + n]
    assert torch.equal(got[6:9], full[2:5])
    assert not got[:6].any() and not got[9:].any()


def test_whole_rank_regions_are_one_run_and_neighbours_merge() -> None:
    layout = LAYOUTS[0]
    cache = torch.empty(layout.tensor_shape(NUM_BLOCKS))
    whole = byte_runs(cache[2:5], cache[5:8])  # contiguous on both sides
    assert whole.tolist() == [[2 * 4 * cache[0].numel(), 5 * 4 * cache[0].numel(),
                               3 * 4 * cache[0].numel()]]
    a, b = cache[1:2, ..., 2:4, :], cache[3:4, ..., 2:4, :]
    assert len(byte_runs(a, b)) == len(_per_token(a, b))  # strided: nothing to merge
    # the first two layers of two blocks into a contiguous tensor: per block, the
    # runs follow each other on both sides, so each block is one run
    src = torch.empty(2, 3, 2, 4, 2, 4)[:, :2]
    dst = torch.empty(2, 2, 2, 4, 2, 4)
    per_block = 2 * 2 * 4 * 2 * 4 * 4
    assert byte_runs(src, dst).tolist() == [[0, 0, per_block],
                                            [3 * per_block // 2, per_block, per_block]]
    with pytest.raises(ValueError, match="shapes"):
        byte_runs(cache[:1], cache[:2])
