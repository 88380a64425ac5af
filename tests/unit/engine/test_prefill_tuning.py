"""The unified kernel's prefill tiles and their start-up tuning (engine.attention.
tuning): every configuration of the prefill search space computes the torch
reference's attention (Triton's interpreter off CUDA, tiny shapes: causal chunks over
cached prefixes, GQA, windows, float8 caches, bfloat16), and the selection logic under
an injected timing function picks the fastest per query length, buckets steps onto its
chunk points (short queries keep the untuned tile), shares the budget with decode and
reaches the launch."""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.triton_attn import PrefillTile  # noqa: E402
from engine.attention.triton_backend import TritonBackend  # noqa: E402
from engine.attention.triton_decode import DecodeTile  # noqa: E402
from engine.attention.tuning import (  # noqa: E402
    BUDGET_S,
    DECODE_SHARE,
    PREFILL_BLOCK_MS,
    PREFILL_ROUNDS,
    PREFILL_STAGES,
    PREFILL_TILE_NS,
    PREFILL_WARPS,
    Budget,
    Point,
    TileTable,
    chunk_points,
    default_prefill_tile,
    search,
    tune_attention,
    tune_prefill_table,
)
from engine.kv_quant import quantize  # noqa: E402
from tests.unit.engine.test_triton_attention import assert_matches, make_case  # noqa: E402
from tests.unit.engine.test_triton_fp8 import run_both as run_both_fp8  # noqa: E402

EVERYWHERE = 1 << 30
SPACE = [PrefillTile(m, n, w, s) for m in PREFILL_BLOCK_MS for n in PREFILL_TILE_NS
         for w in PREFILL_WARPS for s in PREFILL_STAGES]


def tuned(tile: PrefillTile) -> TritonBackend:
    """The backend as the runner leaves it after tuning, holding `tile` for every step
    with a query of 64 tokens or more."""
    table = TileTable(PrefillTile(), ((63, EVERYWHERE),), {(EVERYWHERE,): tile})
    return TritonBackend(prefill_table=table)


# Each value of every axis at least once (rows, keys per tile, warps, stages; the
# interpreter ignores warps and stages, tl.range's pipelining included). The untuned
# 16-row tile: tests/unit/engine/test_triton_attention.py.
CANDIDATES = [PrefillTile(64, 32, 4, 1), PrefillTile(128, 64, 8, 2),
              PrefillTile(64, 128, 8, 3), PrefillTile(128, 128, 4, 4),
              PrefillTile(128, 32, 4, 3)]


@pytest.mark.parametrize("tile", CANDIDATES, ids=str)
def test_every_prefill_candidate_matches_the_reference(tile: PrefillTile) -> None:
    # A fresh prompt longer than two tiles of 128 keys, chunks over cached prefixes (one
    # ending mid-block), a decode row and a padding sequence, 4 query heads per KV head.
    case = make_case([0, 37, 200, 9], [260, 90, 70, 1], group=4, kv_heads=2, pad_seqs=1,
                     seed=(tile.block_m or 0) + (tile.tile_n or 0))
    assert case.meta.max_query_len >= 64
    assert_matches(case, backend=tuned(tile))


@pytest.mark.parametrize("tile", [PrefillTile(64, 32, 4, 2), PrefillTile(128, 128, 8, 3)],
                         ids=str)
def test_prefill_candidates_with_a_window(tile: PrefillTile) -> None:
    # A window of 100 over blocks of 16-32 queries: its edge, whole tiles inside it and
    # the diagonal each take part (and whole tiles before the edge are skipped).
    case = make_case([60, 0, 150], [200, 130, 64], group=2, window=100, seed=5)
    assert_matches(case, backend=tuned(tile))


@pytest.mark.parametrize("tile", [PrefillTile(64, 64, 4, 3), PrefillTile(128, 32, 8, 1)],
                         ids=str)
def test_prefill_candidates_over_an_fp8_cache(tile: PrefillTile) -> None:
    case = make_case([0, 70], [140, 66], group=2, seed=11)
    case.cache = quantize(case.cache, 1.0)
    out, ref = run_both_fp8(case, tuned(tile))
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-5, rtol=1e-5)


def test_bfloat16_prefill_with_the_largest_tiles() -> None:
    case = make_case([33, 0], [100, 150], group=8, kv_heads=1, dtype=torch.bfloat16,
                     seed=13)
    assert_matches(case, atol=2e-2, backend=tuned(PrefillTile(128, 128, 8, 4)))


def test_the_tables_tile_reaches_the_launch_for_long_queries_only() -> None:
    # Keys per tile of 24 are no power of two: the launch fails only if the tile is used.
    backend = tuned(PrefillTile(64, 24))
    with pytest.raises(Exception, match="power of 2|power of two"):
        assert_matches(make_case([10], [64], seed=17), backend=backend)
    assert_matches(make_case([10, 0], [63, 5], seed=17), backend=backend)  # untuned tile
    assert_matches(make_case([10, 3], [1, 1], seed=17), backend=backend)  # decode-only


def test_the_real_tuner_off_cuda_times_the_chunk_point() -> None:
    # The interpreter's timings mean nothing for a GPU; the path is the one CUDA runs:
    # a chunk built on the engine's cache, each candidate launched and timed.
    case = make_case([10, 40], [64, 30], group=2, seed=19)
    tables = tune_attention(case.cache[:, 0], 4, torch.float32, None, max_num_seqs=1,
                            max_model_len=70, max_num_batched_tokens=64, budget_s=300.0,
                            reps=1)
    assert tables.prefill.axes == ((63, 64),)
    assert set(tables.prefill.entries) == {(64,)}
    assert tables.prefill.entries[(64,)] in SPACE
    assert tables.decode.entries  # decode's points were tuned in the same call
    assert_matches(case, backend=TritonBackend(prefill_table=tables.prefill))


# -- selection, with an injected timing function ---------------------------------------

def cost(tile: PrefillTile, point: Point) -> float:
    """A cost whose minimum depends on the query length: long chunks like many rows and
    big key tiles, short ones few; 8 warps and 3 stages are best at length 8192 only."""
    (chunk,) = point
    long = chunk >= 2048
    c = {64: 2.0, 128: 1.0}[tile.block_m or 64] if long else \
        {64: 1.0, 128: 2.0}[tile.block_m or 64]
    c += {32: 0.3, 64: 0.2, 128: 0.1}[tile.tile_n or 64] if long else \
        {32: 0.1, 64: 0.2, 128: 0.3}[tile.tile_n or 64]
    c += {4: 0.02, 8: 0.01}[tile.num_warps] if chunk >= 8192 else \
        {4: 0.01, 8: 0.02}[tile.num_warps]
    c += {1: 0.004, 2: 0.003, 3: 0.001, 4: 0.002}[tile.num_stages] if chunk >= 8192 \
        else {1: 0.001, 2: 0.002, 3: 0.003, 4: 0.004}[tile.num_stages]
    return c * 1e-6 * chunk


def argmin(chunk: int) -> PrefillTile:
    return min(SPACE, key=lambda t: cost(t, (chunk,)))


def test_search_finds_the_fastest_prefill_tile_of_the_whole_space() -> None:
    calls: list[PrefillTile] = []

    def time_fn(tile: PrefillTile, point: Point) -> float:
        calls.append(tile)
        return cost(tile, point)

    for chunk in (512, 8192):
        calls.clear()
        tile, t, t_base = search((chunk,), default_prefill_tile(128), PREFILL_ROUNDS,
                                 time_fn, Budget(math.inf, time.perf_counter))
        assert tile == argmin(chunk)
        assert t == cost(tile, (chunk,)) < t_base
        assert len(calls) == len(set(calls)) <= 1 + 6 + 2 + 4  # each candidate once
    assert argmin(8192) == PrefillTile(128, 128, 8, 3)
    assert argmin(512) == PrefillTile(64, 32, 4, 1)


def test_the_prefill_table_buckets_steps_by_their_longest_query() -> None:
    assert chunk_points(16384, 8193) == (512, 2048, 8192)
    assert chunk_points(2048, 32768) == (512, 2048)
    assert chunk_points(1000, 600) == (512, 600)
    assert chunk_points(4096, 63) == ()
    order: list[int] = []

    def time_fn(tile: PrefillTile, point: Point) -> float:
        order.append(point[0])
        return cost(tile, point)

    table = tune_prefill_table((512, 2048, 8192), default_prefill_tile(128), time_fn)
    assert order[0] == 8192 and order[-1] == 512  # the longest chunk first
    assert table.axes == ((63, 512, 2048, 8192),)
    assert {p: t for p, t in table.entries.items()} == {
        (c,): argmin(c) for c in (512, 2048, 8192)}
    assert table.choose(1) == table.choose(63) == PrefillTile()  # decode rows, short chunks
    assert table.choose(64) == table.choose(512) == argmin(512)
    assert table.choose(513) == argmin(2048)
    assert table.choose(8192) == table.choose(100_000) == argmin(8192)
    assert TritonBackend().prefill_table.choose(8192) == PrefillTile()


def test_decode_and_prefill_share_one_budget() -> None:
    now = [0.0]
    spent = {"decode": 0.0, "prefill": 0.0}

    def charge(kind: str):
        def time_fn(tile: object, point: Point) -> float:
            now[0] += 0.75  # each timing costs 0.75 s of the budget
            spent[kind] += 0.75
            return 1e-5
        return time_fn

    layer = torch.zeros((8, 2, 16, 2, 16))
    tables = tune_attention(layer, 4, torch.float32, None, max_num_seqs=256,
                            max_model_len=8192, max_num_batched_tokens=16384,
                            clock=lambda: now[0],
                            time_fns=(charge("decode"), charge("prefill")))
    assert now[0] <= BUDGET_S + 2 * 0.75
    assert spent["decode"] <= BUDGET_S * DECODE_SHARE + 0.75
    assert spent["prefill"] >= BUDGET_S * (1 - DECODE_SHARE) - 0.75
    # equal times keep the base: the untuned tile spelled out, at the points reached
    assert tables.prefill.entries[(8192,)] == default_prefill_tile(16)
    assert set(tables.decode.entries.values()) == {DecodeTile(64)}
    assert len(tables.decode.entries) < 8  # decode's share ran out first


# Compiled for Hopper (sm_90) in a fresh process without the interpreter: Triton
# compiles without a GPU (its own ptxas), so lowering, the pipeliner and shared memory
# are checked here too, which the interpreter never does. The extremes of the prefill
# space (the most rows and keys with the deepest pipeline; the untuned tile with a
# window over a float8 cache), and the kernels that share its tile step and float8
# conversions: split-K decode and the KV write over a float8 cache; and DeepSeek's two
# latent (MLA) attention kernels at the DeepSeek-V3 shape (rank 512, rope 64).
COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.attention import triton_attn, triton_decode, triton_mla

def build(fn, const, warps, stages):
    cache = "*fp8e4nv" if const.get("FP8") else "*bf16"
    sig = {a: "constexpr" if a in const else cache if a == "cache_ptr"
           else "*fp32" if a.endswith("scale_ptr") or a in ("part_ptr", "lse_ptr")
           else "*i32" if a in ("bt_ptr", "seq_lens_ptr", "qsl_ptr", "slot_ptr")
           else "*bf16" if a.endswith("_ptr") else "fp32" if a == "scale_log2" else "i32"
           for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    assert 0 <= k.metadata.shared <= 227 * 1024, k.metadata.shared
    return k

common = dict(BLOCK_SIZE=16, HEAD_DIM=128, DOT_PRECISION="tf32", DOT_F32=False,
              FP8_BITS=False)
for m, n, w, s, window, fp8 in ((128, 128, 8, 4, False, False), (64, 64, 4, 3, True, True)):
    k = build(triton_attn._unified_kernel,
              dict(common, GROUP=4, BLOCK_M=m, BLOCK_Q=m // 4, TILE_N=n, USE_WINDOW=window,
                   FP8=fp8, NUM_STAGES=s), w, s)
    # the pipelined loop's K/V loads go through asynchronous copies
    assert "async_copy_global_to_local" in k.asm["ttgir"]
build(triton_decode._decode_split_kernel,
      dict(common, GROUP=4, BLOCK_M=16, TILE_N=64, USE_WINDOW=False, FP8=True), 4, 3)
build(triton_attn._write_kv_kernel,
      dict(BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_H=8, FP8=True, FP8_BITS=False), 4, 3)
mla = dict(RANK=512, ROPE=64, BLOCK_SIZE=16, BLOCK_R=512, BLOCK_P=64, BLOCK_H=16,
           DOT_PRECISION="tf32", DOT_F32=False)
build(triton_mla._mla_decode_kernel, dict(mla, BLOCK_N=16, NUM_SPLITS=4), 4, 3)
build(triton_mla._mla_absorbed_kernel, dict(mla, BLOCK_Q=1, TILE_N=16), 4, 3)
print("compiled")
"""


def test_prefill_candidates_compile_for_hopper() -> None:
    import subprocess
    import sys

    nvidia = pytest.importorskip("triton.backends.nvidia")
    if not os.path.exists(os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")):
        pytest.skip("triton's nvidia backend ships no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def test_a_mixed_graph_takes_its_token_buckets_entry() -> None:
    from engine.mixed_graphs import MixedGraphs

    table = tune_prefill_table(chunk_points(512, 4096), default_prefill_tile(128), cost)
    graphs = MixedGraphs(lambda *a: torch.zeros(0), 512, 8, 4096 // 16, 100,
                         torch.device("cpu"), None, 4096, capture=False)
    for t in graphs.buckets:  # warm-up, capture and replay all read this metadata
        want = table.entries[(512,)] if t >= 64 else PrefillTile()
        assert table.choose(graphs._meta(t).max_query_len) == want
    assert PrefillTile() in {table.choose(graphs._meta(t).max_query_len)
                             for t in graphs.buckets}
