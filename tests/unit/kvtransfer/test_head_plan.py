"""`kvtransfer.layout.head_map` / `head_plan`: which rank holds which KV heads, and
which source rank fills which heads of each destination rank, for every pair of TP
sizes that divide (or are divided by) the head count, replicated heads included."""

from __future__ import annotations

import pytest

from kvtransfer.layout import HeadSlice, head_map, head_plan, local_heads


def _sizes(heads: int) -> list[int]:
    """TP sizes for `heads` KV heads: its divisors and a few multiples."""
    return [t for t in range(1, heads + 1) if heads % t == 0] + [heads * 2, heads * 4]


def test_head_map_splits_and_replicates() -> None:
    assert head_map(8, 2) == [(0, 4), (4, 8)]
    assert head_map(2, 2) == [(0, 1), (1, 2)]
    assert head_map(1, 2) == [(0, 1), (0, 1)]  # one KV head, replicated
    assert head_map(2, 4) == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert local_heads(8, 4) == 2 and local_heads(1, 4) == 1
    with pytest.raises(ValueError, match="do not split"):
        head_map(6, 4)
    with pytest.raises(ValueError, match="replicated"):
        head_map(2, 3)


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_every_destination_head_comes_from_a_source_that_holds_it(heads: int) -> None:
    for p in _sizes(heads):
        for d in _sizes(heads):
            src, dst = head_map(heads, p), head_map(heads, d)
            plan = head_plan(p, d, heads)
            assert len(plan) == d
            for r, slices in enumerate(plan):
                first, end = dst[r]
                filled: list[int] = []  # the model's head index of each destination head
                for s in slices:
                    a, b = src[s.src_rank]
                    assert 0 <= s.src_head and s.src_head + s.num_heads <= b - a
                    assert s.dst_head == len(filled)  # in order, no gap, no overlap
                    filled += range(a + s.src_head, a + s.src_head + s.num_heads)
                assert filled == list(range(first, end)), (p, d, r)


def test_plans_by_shape() -> None:
    # TP 2 -> 2: rank r to rank r, each whole
    assert head_plan(2, 2, 8) == [[HeadSlice(0, 0, 0, 4)], [HeadSlice(1, 0, 0, 4)]]
    # TP 2 -> 1: both source ranks fill the one destination
    assert head_plan(2, 1, 8) == [[HeadSlice(0, 0, 0, 4), HeadSlice(1, 0, 4, 4)]]
    # TP 1 -> 2: each destination rank takes its half of the one source
    assert head_plan(1, 2, 8) == [[HeadSlice(0, 0, 0, 4)], [HeadSlice(0, 4, 0, 4)]]
    # one replicated head: TP 2 -> 2 is rank to rank, TP 1 -> 2 both from rank 0,
    # TP 2 -> 1 from one holder only
    assert head_plan(2, 2, 1) == [[HeadSlice(0, 0, 0, 1)], [HeadSlice(1, 0, 0, 1)]]
    assert head_plan(1, 2, 1) == [[HeadSlice(0, 0, 0, 1)], [HeadSlice(0, 0, 0, 1)]]
    assert head_plan(2, 1, 1) == [[HeadSlice(0, 0, 0, 1)]]
    # replicated on the source, split on the destination: 2 heads, TP 4 -> 2
    assert head_plan(4, 2, 2) == [[HeadSlice(0, 0, 0, 1)], [HeadSlice(3, 0, 0, 1)]]


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_head_map_is_the_engines_sharding(heads: int) -> None:
    from engine.config import ModelConfig
    from engine.models.parallel_layers import kv_head_range
    from tests.factories import tiny_model_dir

    cfg = ModelConfig.from_model_dir(tiny_model_dir(
        "llama", num_key_value_heads=heads, num_attention_heads=8))
    for tp in _sizes(heads):
        assert head_map(heads, tp) == [kv_head_range(cfg, r, tp) for r in range(tp)]
