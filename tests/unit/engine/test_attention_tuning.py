"""Split-K decode's start-up tuning (engine.attention.tuning): every configuration of
the search space computes the torch reference's attention (Triton's interpreter off
CUDA, tiny shapes), and the selection logic under an injected timing function picks
the fastest, buckets steps onto its grid, keeps its budget and falls back to the
untuned configuration. The prefill tiles' tuning: test_prefill_tuning.py."""

from __future__ import annotations

import argparse
import math
import time

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.triton_backend import TritonBackend  # noqa: E402
from engine.attention.triton_decode import DecodeTile  # noqa: E402
from engine.attention.tuning import (  # noqa: E402
    DECODE_ROUNDS,
    STAGES,
    TILE_NS,
    WARPS,
    WAVES,
    Budget,
    Point,
    TileTable,
    default_tile,
    grid_points,
    search,
    tune_attention,
    tune_decode_table,
)
from engine.config import EngineConfig  # noqa: E402
from engine.kv_quant import quantize  # noqa: E402
from tests.unit.engine.test_triton_attention import assert_matches, make_case  # noqa: E402
from tests.unit.engine.test_triton_fp8 import run_both as run_both_fp8  # noqa: E402

EVERYWHERE = 1 << 30  # a grid point covering every step: the table always answers


def tuned(tile: DecodeTile, splits: int) -> TritonBackend:
    """The backend as the runner leaves it after tuning, holding `tile` for all steps."""
    table = TileTable(DecodeTile(), ((EVERYWHERE,), (EVERYWHERE,)),
                      {(EVERYWHERE, EVERYWHERE): tile})
    return TritonBackend(num_splits=splits, decode_table=table)


# Each value of every axis at least once (tile_n, warps, stages, split count), with
# ragged contexts from 0 to past 2 tiles of 128 keys; splits stand for the split rule's
# outcomes (on CUDA a power of two up to 16; the interpreter ignores warps and stages).
CANDIDATES = [(DecodeTile(32, 2, 1), 1), (DecodeTile(64, 4, 2), 4),
              (DecodeTile(128, 8, 3), 16), (DecodeTile(128, 2, 2), 1),
              (DecodeTile(32, 8, 3), 16), (DecodeTile(64, 2, 1), 8)]


@pytest.mark.parametrize("tile,splits", CANDIDATES, ids=str)
def test_every_candidate_decodes_as_the_reference(tile: DecodeTile, splits: int) -> None:
    case = make_case([0, 15, 64, 129, 300], [1] * 5, group=4, kv_heads=2, pad_seqs=1,
                     seed=tile.tile_n or 0)
    assert case.meta.is_decode_only
    assert_matches(case, backend=tuned(tile, splits))


@pytest.mark.parametrize("tile_n,splits", [(32, 16), (128, 2)])
def test_candidates_with_a_window(tile_n: int, splits: int) -> None:
    case = make_case([10, 70, 200], [1] * 3, group=2, window=48, seed=7)
    assert_matches(case, backend=tuned(DecodeTile(tile_n, 8, 1), splits))


@pytest.mark.parametrize("tile_n,splits", [(32, 4), (128, 16)])
def test_candidates_over_an_fp8_cache(tile_n: int, splits: int) -> None:
    case = make_case([0, 33, 150], [1] * 3, group=2, seed=11)
    case.cache = quantize(case.cache, 1.0)
    out, ref = run_both_fp8(case, tuned(DecodeTile(tile_n, 2, 3), splits))
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-5, rtol=1e-5)


def test_bfloat16_with_the_largest_tile() -> None:
    case = make_case([5, 140], [1, 1], group=8, dtype=torch.bfloat16, seed=13)
    assert_matches(case, atol=2e-2, backend=tuned(DecodeTile(128, 4, 2), 4))


def test_the_real_tuner_off_cuda_times_every_point() -> None:
    # The interpreter's timings mean nothing for a GPU; the path is the one CUDA runs:
    # inputs built on the engine's cache, each candidate launched and timed.
    case = make_case([30, 50], [1, 1], group=2, seed=19)
    tables = tune_attention(case.cache[:, 0], 4, torch.float32, None, max_num_seqs=2,
                            max_model_len=40, max_num_batched_tokens=64, budget_s=120.0,
                            reps=1)
    table = tables.decode
    assert table.axes == ((1, 2), (40,))
    assert not tables.prefill.entries  # no query of 64 tokens fits: nothing to tune
    space = {DecodeTile(n, w, s, v) for n in TILE_NS for w in WARPS for s in STAGES
             for v in WAVES}
    assert set(table.entries) == {(1, 40), (2, 40)}
    assert set(table.entries.values()) <= space
    chosen = table.choose(case.meta.num_seqs, case.meta.max_seq_len)
    assert chosen == table.entries[(2, 40)]
    assert_matches(case, backend=TritonBackend(decode_table=table))


# -- selection, with an injected timing function ---------------------------------------

def separable(tile: DecodeTile, point: Point) -> float:
    """A cost whose minimum depends on the point: small batches like big tiles and many
    waves, large ones small tiles and few; warps 8 and stages 2 are best everywhere."""
    batch, context = point
    big = batch <= 8
    cost = {32: 3.0, 64: 2.0, 128: 1.0}[tile.tile_n or 64] if big else \
        {32: 1.0, 64: 2.0, 128: 3.0}[tile.tile_n or 64]
    cost += {2: 0.3, 4: 0.2, 8: 0.1}[tile.num_warps] + {1: 0.05, 2: 0.01, 3: 0.03}[
        tile.num_stages]
    cost += {1: 0.004, 2: 0.002, 4: 0.001}[tile.waves] if big else \
        {1: 0.001, 2: 0.002, 4: 0.004}[tile.waves]
    return cost * 1e-6 * context


def full_argmin(batch: int, context: int) -> DecodeTile:
    space = [DecodeTile(n, w, s, v) for n in TILE_NS for w in WARPS for s in STAGES
             for v in WAVES]
    return min(space, key=lambda t: separable(t, (batch, context)))


def test_search_finds_the_fastest_of_the_whole_space() -> None:
    calls = []

    def time_fn(tile: DecodeTile, point: Point) -> float:
        calls.append(tile)
        return separable(tile, point)

    for batch in (1, 128):
        calls.clear()
        tile, t, t_base = search((batch, 1024), default_tile(128), DECODE_ROUNDS, time_fn,
                                 Budget(math.inf, time.perf_counter))
        assert tile == full_argmin(batch, 1024)
        assert t == separable(tile, (batch, 1024)) < t_base
        assert len(calls) == len(set(calls)) <= 1 + 9 + 3 + 3  # each candidate timed once
    assert full_argmin(1, 1024) == DecodeTile(128, 8, 2, 4)
    assert full_argmin(128, 1024) == DecodeTile(32, 8, 2, 1)


def test_a_candidate_that_fails_is_ruled_out() -> None:
    def time_fn(tile: DecodeTile, point: Point) -> float:
        if tile.tile_n == 128:
            raise RuntimeError("out of resources: shared memory")
        return separable(tile, point)

    tile, _, _ = search((1, 1024), default_tile(128), DECODE_ROUNDS, time_fn, Budget(math.inf, time.perf_counter))
    assert tile == DecodeTile(64, 8, 2, 4)


def test_equal_times_keep_the_untuned_tile() -> None:
    tile, _, _ = search((8, 1024), default_tile(64), DECODE_ROUNDS, lambda t, p: 1e-5,
                        Budget(math.inf, time.perf_counter))
    assert tile == DecodeTile(64, 4, 3, 2) == default_tile(64)
    assert default_tile(256).tile_n == 32


def test_table_buckets_steps_onto_its_grid() -> None:
    batches, contexts = grid_points(max_num_seqs=64, max_model_len=4096)
    assert (batches, contexts) == ((1, 8, 32, 64), (1024, 4096))
    assert grid_points(256, 32768) == ((1, 8, 32, 128), (1024, 8192))
    table = tune_decode_table(batches, contexts, default_tile(128), separable)
    assert set(table.entries) == {(b, c) for b in batches for c in contexts}
    for (b, c), tile in table.entries.items():
        assert tile == full_argmin(b, c)
    # the smallest point covering the step, else the largest
    assert table.choose(1, 1) == table.entries[(1, 1024)]
    assert table.choose(5, 1025) == table.entries[(8, 4096)]
    assert table.choose(33, 900) == table.entries[(64, 1024)]
    assert table.choose(500, 100_000) == table.entries[(64, 4096)]


def test_a_decode_graph_takes_its_batch_sizes_longest_context_entry() -> None:
    from engine.cuda_graphs import DecodeGraphs

    batches, contexts = grid_points(max_num_seqs=16, max_model_len=2048)
    table = tune_decode_table(batches, contexts, default_tile(128), separable)
    graphs = DecodeGraphs(lambda *a: torch.zeros(0), 16, 2048 // 16, torch.device("cpu"),
                          None, capture=False, max_seq_len=2048)
    for b, want in ((1, 1), (5, 8), (16, 16)):
        meta = graphs._inputs(graphs.bucket_for(b) or 0)[2]
        assert table.choose(meta.num_seqs, meta.max_seq_len) == table.entries[(want, 2048)]
    assert table.entries[(1, 2048)] != table.entries[(16, 2048)]


def test_budget_stops_tuning_and_untuned_points_take_the_default() -> None:
    now = [0.0]

    def clock() -> float:
        return now[0]

    def time_fn(tile: DecodeTile, point: Point) -> float:
        now[0] += 0.1  # each timing costs 0.1 s of the budget
        return separable(tile, point)

    table = tune_decode_table((1, 8, 32), (1024,), default_tile(128), time_fn, budget_s=2.0,
                              clock=clock)
    assert now[0] <= 2.0 + 0.1 + 1e-9
    # the largest batches first: the budget ends before the smallest
    assert (32, 1024) in table.entries and (1, 1024) not in table.entries
    assert table.choose(1, 512) == DecodeTile()
    assert TileTable(DecodeTile()).choose(4, 4096) == DecodeTile()
    assert TritonBackend().decode_table.choose(4, 4096) == DecodeTile()


def test_a_candidate_starts_only_if_the_longest_so_far_would_end_in_the_budget() -> None:
    """A cold compile takes seconds: after a 9 s base in a 10 s budget no candidate
    starts (it would end past the budget), so tuning ends at 9 s, not 18."""
    now = [0.0]
    compiled: set[DecodeTile] = set()

    def time_fn(tile: DecodeTile, point: Point) -> float:
        now[0] += 0.1 if tile in compiled else 9.0
        compiled.add(tile)
        return separable(tile, point)

    table = tune_decode_table((1,), (1024,), default_tile(128), time_fn, budget_s=10.0,
                              clock=lambda: now[0])
    assert now[0] == 9.0 and compiled == {default_tile(128)}
    assert table.entries[(1, 1024)] == default_tile(128)


def test_tuning_is_on_for_cuda_with_triton_only(tmp_path) -> None:
    from engine.cli import add_engine_arguments, engine_config_from_args

    d = str(tmp_path)
    assert EngineConfig(d, device="cuda").tunes_attention
    assert not EngineConfig(d, device="cuda", attention_tuning="off").tunes_attention
    assert not EngineConfig(d, device="cuda", attention_backend="torch").tunes_attention
    assert not EngineConfig(d, device="cpu", attention_backend="triton").tunes_attention
    with pytest.raises(ValueError, match="attention tuning"):
        EngineConfig(d, attention_tuning="on")
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    args = p.parse_args(["--model", d, "--device", "cpu", "--attention-tuning", "off"])
    assert engine_config_from_args(args).attention_tuning == "off"
    args = p.parse_args(["--model", d, "--device", "cpu"])
    assert engine_config_from_args(args).attention_tuning == "auto"


def test_the_tables_tile_reaches_the_launch() -> None:
    # A tile of 24 keys is no power of two: the launch fails only if it is used.
    case = make_case([40], [1], seed=17)
    with pytest.raises(Exception, match="power of 2|power of two"):
        assert_matches(case, backend=tuned(DecodeTile(24), 4))
