"""A write of whole blocks as block ids (`layout.WholeBlocks`) and runs
(`region_rows.BlockPairs`), held to the `Region` pairs `coalesce` makes of the same
blocks: their pairs, rows, block ids and the copy kernel's plan."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvtransfer import KVLayout, Region, coalesce
from kvtransfer import region_rows as rr
from kvtransfer.copy_kernel import plan_blocks
from kvtransfer.layout import WholeBlocks, whole_blocks

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")


def test_block_pairs_are_the_pairs_coalesce_makes_of_whole_blocks() -> None:
    """A write of `whole_blocks` on both sides (`BlockPairs`): its pairs, their rows,
    their slices and the copy kernel's plan equal those of the same blocks as Regions."""
    rng = random.Random(3)
    for _ in range(60):
        n = rng.randrange(1, 150)  # runs found on plain ints, and by numpy
        src = sorted(rng.sample(range(400), n))
        dst = [d for d in (rng.randrange(400) for _ in range(n))]
        for i in range(1, n):  # runs on both sides now and then
            if rng.random() < 0.4:
                src[i], dst[i] = src[i - 1] + 1, dst[i - 1] + 1
        s, d = [Region(b) for b in src], [Region(b) for b in dst]
        want = coalesce(s, d, LAYOUT)
        pairs = rr.BlockPairs.of(src, dst)
        assert list(pairs) == want and len(pairs) == len(want)
        assert [pairs[i] for i in range(len(pairs))] == want
        assert list(pairs[1:3]) == want[1:3]
        for side, at in (("src", 0), ("dst", 1)):
            rows = rr.rows_of((p[at] for p in want), LAYOUT)
            assert np.array_equal(rr.side_rows(pairs, side, LAYOUT), rows)
            assert np.array_equal(rr.side_rows(want, side, LAYOUT), rows)
            assert pairs.block_ids(side) == (src if side == "src" else dst)
        assert plan_blocks(pairs, LAYOUT, 500, 500) == plan_blocks(want, LAYOUT, 500, 500)
    with pytest.raises(ValueError, match="2 source regions but 1"):
        rr.BlockPairs.of([1, 2], [3])
    with pytest.raises(ValueError, match="destination blocks 7..7"):
        plan_blocks(rr.BlockPairs.of([1], [7]), LAYOUT, 8, 7)
    assert list(rr.BlockPairs.of([], [])) == [] and plan_blocks(rr.BlockPairs.of([], []),
                                                                 LAYOUT, 8, 8) == {}


def test_whole_blocks_read_as_their_regions() -> None:
    ids = [5, 3, 9, 10]
    blocks = whole_blocks(ids)
    regions = [Region(b) for b in ids]
    assert isinstance(blocks, WholeBlocks) and len(blocks) == 4
    assert list(blocks) == regions and blocks == regions and blocks[1] == Region(3)
    assert blocks[1:3] == whole_blocks([3, 9]) and blocks[-1] == Region(10)
    assert np.array_equal(rr.rows_of(blocks, LAYOUT), rr.rows_of(regions, LAYOUT))
    assert rr.rows_of(whole_blocks([]), LAYOUT).shape == (0, 7)
