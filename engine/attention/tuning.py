"""Start-up tuning of the Triton attention kernels' launch configurations: split-K
decode's (`DecodeTile`, engine.attention.triton_decode) and the unified kernel's
prefill tiles (`PrefillTile`, engine.attention.triton_attn). For this rank's shape
(heads, KV heads, head dim, block size, compute and cache dtype, window), a few
representative points of each kernel get the fastest of a small set of
configurations, timed with CUDA events on the engine's own KV cache:

    decode:  (batch, context) in BATCH_POINTS x CONTEXT_POINTS, `batch` sequences of
             `context` cached tokens, one query each
    prefill: (query length,) in CHUNK_POINTS, one sequence's chunk of that many new
             tokens without cached context, as a prompt's first step

The results are tables (`TileTable`) the Triton backend looks up from host ints on
every launch, so they are decided before CUDA graphs are captured and each graph keeps
its bucket's choice.

Every candidate computes the same attention (tiles, warps, stages and split count
change the order of the sums, so results agree up to rounding: in bf16 two starts that
choose different tiles can differ in the last bits). It is bounded: a coordinate search
over each kernel's axes (`DECODE_ROUNDS`, `PREFILL_ROUNDS`), a couple of timed launches
per candidate and one wall-clock budget that decode and prefill share (decode first, to
DECODE_SHARE of it; prefill takes the rest). A candidate starts only if the longest one
so far, its compile included, would still end within the budget; the points not
reached keep the untuned configuration. Triton's
on-disk cache keeps what a search compiled, so a later start on the same machine goes
further in the same budget.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Generic, TypeVar

import torch
import triton

from engine.attention import triton_attn, triton_decode
from engine.attention.triton_attn import LONG_QUERY, PrefillTile
from engine.attention.triton_decode import DecodeTile

logger = logging.getLogger(__name__)

TUNING_MODES = ("auto", "off")
BUDGET_S = 30.0
DECODE_SHARE = 0.6
REPS = 3
# decode's axes
BATCH_POINTS = (1, 8, 32, 128)
CONTEXT_POINTS = (1024, 8192)
TILE_NS = (32, 64, 128)
WARPS = (2, 4, 8)
STAGES = (1, 2, 3)
WAVES = (1, 2, 4)
# prefill's axes (query lengths from LONG_QUERY up; shorter steps keep the untuned
# tile). Each lists its likeliest values first (FlashAttention-2's Triton tiles: 128
# rows, 64-128 keys): on a cold Triton cache every candidate compiles first (1-14 s
# each for sm_90, compiled offline on a 2-vCPU shared AMD EPYC, 2026-12-03), so the
# budget may end the search early.
CHUNK_POINTS = (512, 2048, 8192)
PREFILL_BLOCK_MS = (128, 64)
PREFILL_TILE_NS = (64, 128, 32)
PREFILL_WARPS = (4, 8)
PREFILL_STAGES = (2, 4, 1, 3)

T = TypeVar("T", bound=Hashable)
Point = tuple[int, ...]
# time_fn(tile, point) -> seconds per launch; it may raise (a configuration that does
# not compile or fit on this GPU), which rules the candidate out.
TimeFn = Callable[[Any, Point], float]
# One round of a coordinate search: the candidates around the best tile so far.
Round = Callable[[Any], list[Any]]

DECODE_ROUNDS: tuple[Round, ...] = (
    lambda b: [DecodeTile(n, w, b.num_stages, b.waves) for n in TILE_NS for w in WARPS],
    lambda b: [DecodeTile(b.tile_n, b.num_warps, s, b.waves) for s in STAGES],
    lambda b: [DecodeTile(b.tile_n, b.num_warps, b.num_stages, v) for v in WAVES],
)
PREFILL_ROUNDS: tuple[Round, ...] = (
    lambda b: [PrefillTile(m, n, b.num_warps, b.num_stages)
               for m in PREFILL_BLOCK_MS for n in PREFILL_TILE_NS],
    lambda b: [PrefillTile(b.block_m, b.tile_n, w, b.num_stages) for w in PREFILL_WARPS],
    lambda b: [PrefillTile(b.block_m, b.tile_n, b.num_warps, s) for s in PREFILL_STAGES],
)


def _bucket(points: Sequence[int], value: int) -> int:
    """The smallest point >= value, else the largest (points ascending)."""
    return next((p for p in points if p >= value), points[-1])


def describe(tile: Any) -> str:
    """'field value' pairs of a tile data class."""
    return " ".join(f"{f.name} {getattr(tile, f.name)}" for f in fields(tile))


@dataclass(frozen=True)
class TileTable(Generic[T]):
    """Tuned tiles of one kernel on a grid of points, one axis per step feature
    (decode: sequence count, longest sequence; prefill: longest query). A step takes
    the entry of the smallest grid point covering it on every axis (the largest where
    none does); a point without an entry, or an empty table, gives `untuned`."""

    untuned: T
    axes: tuple[tuple[int, ...], ...] = ()
    entries: dict[Point, T] = field(default_factory=dict)

    def choose(self, *values: int) -> T:
        if not self.entries:
            return self.untuned
        key = tuple(_bucket(axis, v) for axis, v in zip(self.axes, values, strict=True))
        return self.entries.get(key, self.untuned)

    def describe(self) -> str:
        return "; ".join(f"<={'x'.join(map(str, p))}: {describe(t)}"
                         for p, t in sorted(self.entries.items()))


def grid_points(max_num_seqs: int, max_model_len: int) -> tuple[tuple[int, ...],
                                                                 tuple[int, ...]]:
    """Decode's batch and context points, clipped to what the engine can run."""
    batches = tuple(sorted({min(b, max_num_seqs) for b in BATCH_POINTS}))
    contexts = tuple(sorted({min(c, max_model_len) for c in CONTEXT_POINTS}))
    return batches, contexts


def chunk_points(max_num_batched_tokens: int, max_model_len: int) -> tuple[int, ...]:
    """Prefill's query-length points, clipped to the longest query a step can hold;
    none below LONG_QUERY."""
    limit = min(max_num_batched_tokens, max_model_len)
    return tuple(sorted({min(c, limit) for c in CHUNK_POINTS} - set(range(LONG_QUERY))))


def prefill_axis(chunks: Sequence[int]) -> tuple[int, ...]:
    """The prefill table's axis: a first bucket for steps whose longest query is under
    LONG_QUERY tokens (decode rows, short chunks), never tuned, so that those keep the
    untuned tile, then the tuned chunk points."""
    return (LONG_QUERY - 1, *chunks)


def default_tile(head_dim: int) -> DecodeTile:
    """Decode's untuned configuration, spelled out (triton_attn._tile_n on CUDA)."""
    return DecodeTile(tile_n=64 if head_dim <= 128 else 32)


def default_prefill_tile(head_dim: int) -> PrefillTile:
    """The unified kernel's untuned configuration for a long query on CUDA, spelled
    out (triton_attn._block_m and _tile_n)."""
    return PrefillTile(block_m=triton_attn.LONG_ROWS, tile_n=default_tile(head_dim).tile_n)


class Budget:
    """A search's wall-clock budget: `deadline` (a clock() value) and the longest one
    timing took so far, its compile included; a timing starts only if one that long
    would still end by the deadline."""

    def __init__(self, deadline: float, clock: Callable[[], float]) -> None:
        self.deadline = deadline
        self.clock = clock
        self.longest = 0.0

    def fits(self) -> bool:
        return self.clock() + self.longest <= self.deadline

    def took(self, t0: float) -> None:
        self.longest = max(self.longest, self.clock() - t0)


def search(point: Point, base: T, rounds: Sequence[Round], time_fn: TimeFn,
           budget: Budget) -> tuple[T, float, float]:
    """The fastest tile for one point: (tile, its seconds, the base tile's seconds).
    Each round's candidates are built around the best so far (decode: tile size x
    warps, then stages, then the split rule's waves; prefill: rows x keys per tile,
    then warps, then pipeline stages); ties keep the earlier candidate. Once the
    budget has no room for another timing, the best found so far stands."""
    times: dict[T, float] = {}

    def timed(tile: T) -> float:
        if tile not in times:
            t0 = budget.clock()
            try:
                times[tile] = time_fn(tile, point)
            except Exception as e:  # noqa: BLE001 - a candidate this GPU cannot run
                logger.debug("attention tuning: %s ruled out at %s: %s", tile, point, e)
                times[tile] = math.inf
            budget.took(t0)
        return times[tile]

    best, best_t = base, timed(base)
    for make in rounds:
        for tile in make(best):
            if tile not in times and not budget.fits():
                return best, best_t, times[base]
            t = timed(tile)
            if t < best_t:
                best, best_t = tile, t
    return best, best_t, times[base]


def tune_table(kind: str, axes: Sequence[Sequence[int]], points: Sequence[Point],
               base: T, untuned: T, rounds: Sequence[Round], time_fn: TimeFn,
               budget_s: float = BUDGET_S,
               clock: Callable[[], float] = time.perf_counter) -> TileTable[T]:
    """Searches `points` (of the grid `axes`), in order, within `budget_s` seconds in
    all, from `base`; points not reached keep no entry (`untuned`). Logs the table at
    INFO, `kind` naming the kernel."""
    start = clock()
    budget = Budget(start + budget_s, clock)
    entries: dict[Point, T] = {}
    notes = []
    for point in points:
        if not budget.fits():
            break
        tile, t, t_base = search(point, base, rounds, time_fn, budget)
        if math.isfinite(t):
            entries[point] = tile
            notes.append(f"{'x'.join(map(str, point))}: {t * 1e6:.1f} us "
                         f"(untuned {t_base * 1e6:.1f} us)")
    table = TileTable(untuned, tuple(tuple(a) for a in axes), entries)
    missed = len(points) - len(entries)
    logger.info("attention tuning (%s): %d points in %.1f s%s: %s [%s]", kind, len(entries),
                clock() - start, f", {missed} untuned (budget)" if missed else "",
                table.describe() or "untuned", "; ".join(notes))
    return table


def tune_decode_table(batches: Sequence[int], contexts: Sequence[int], base: DecodeTile,
                      time_fn: TimeFn, budget_s: float = BUDGET_S,
                      clock: Callable[[], float] = time.perf_counter
                      ) -> TileTable[DecodeTile]:
    """Decode's table over every (batch, context) point, the largest batches and
    longest contexts first: the steps that take the most time (a throughput run's),
    and the ones a budget cut short on a cold Triton cache would otherwise leave
    untuned (the first point's search compiles most candidates; later points mostly
    time compiled ones)."""
    points = [(b, c) for b in sorted(batches, reverse=True)
              for c in sorted(contexts, reverse=True)]
    return tune_table("decode", (batches, contexts), points, base, DecodeTile(),
                      DECODE_ROUNDS, time_fn, budget_s, clock)


def tune_prefill_table(chunks: Sequence[int], base: PrefillTile, time_fn: TimeFn,
                       budget_s: float = BUDGET_S,
                       clock: Callable[[], float] = time.perf_counter
                       ) -> TileTable[PrefillTile]:
    """The unified kernel's table over the chunk points, the longest first (the
    compute-bound steps; the configurations compiled there serve the shorter points'
    timings)."""
    points = [(c,) for c in sorted(chunks, reverse=True)]
    return tune_table("prefill", (prefill_axis(chunks),), points, base, PrefillTile(),
                      PREFILL_ROUNDS, time_fn, budget_s, clock)


def _timer(launch: Callable[[], None], device: torch.device, reps: int) -> float:
    """Seconds per launch: one untimed launch (it compiles), then `reps` launches
    between two CUDA events (off CUDA, the interpreter: the host's clock)."""
    launch()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            launch()
        return (time.perf_counter() - start) / reps
    begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    begin.record()
    for _ in range(reps):
        launch()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / reps / 1e3


class _Inputs:
    """Random attention inputs over `kv_layer` (only read), built once per point:
    `num_seqs` sequences of `seq_len` tokens, the last `q_len` of each new, their
    blocks drawn at random from the pool."""

    def __init__(self, kv_layer: torch.Tensor, num_heads: int, dtype: torch.dtype,
                 seed: int) -> None:
        self.kv_layer, self.num_heads, self.dtype = kv_layer, num_heads, dtype
        self.gen = torch.Generator().manual_seed(seed)
        self.made: dict[Point, tuple] = {}

    def get(self, num_seqs: int, seq_len: int, q_len: int) -> tuple:
        key = (num_seqs, seq_len, q_len)
        if key not in self.made:
            device, kv = self.kv_layer.device, self.kv_layer
            width = triton.cdiv(seq_len, kv.shape[2])
            tables = torch.randint(0, kv.shape[0], (num_seqs, width), generator=self.gen,
                                   dtype=torch.int32).to(device)
            q = torch.randn((num_seqs * q_len, self.num_heads, kv.shape[4]),
                            generator=self.gen).to(self.dtype).to(device)
            lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
            qsl_cpu = list(range(0, num_seqs * q_len + 1, q_len))
            qsl = torch.tensor(qsl_cpu, dtype=torch.int32, device=device)
            self.made[key] = (q, tables, lens, qsl, qsl_cpu)
        return self.made[key]


def decode_timer(kv_layer: torch.Tensor, num_heads: int, dtype: torch.dtype,
                 sliding_window: int | None, reps: int = REPS, seed: int = 0) -> TimeFn:
    """Times decode_attention on `kv_layer` (a layer's view of the engine's cache;
    only read) at (batch, context): `batch` sequences of `context` tokens each."""
    inputs = _Inputs(kv_layer, num_heads, dtype, seed)
    scale = kv_layer.shape[4] ** -0.5

    def time_fn(tile: DecodeTile, point: Point) -> float:
        batch, context = point
        q, tables, lens, qsl, qsl_cpu = inputs.get(batch, context, 1)

        def launch() -> None:
            triton_decode.decode_attention(q, kv_layer, tables, lens, qsl, qsl_cpu, scale,
                                           sliding_window, tile=tile)

        return _timer(launch, kv_layer.device, reps)

    return time_fn


def prefill_timer(kv_layer: torch.Tensor, num_heads: int, dtype: torch.dtype,
                  sliding_window: int | None, reps: int = REPS, seed: int = 0) -> TimeFn:
    """Times unified_attention on `kv_layer` (only read) at (chunk,): one sequence of
    `chunk` new tokens, no cached context."""
    inputs = _Inputs(kv_layer, num_heads, dtype, seed)
    scale = kv_layer.shape[4] ** -0.5

    def time_fn(tile: PrefillTile, point: Point) -> float:
        (chunk,) = point
        q, tables, lens, qsl, qsl_cpu = inputs.get(1, chunk, chunk)

        def launch() -> None:
            triton_attn.unified_attention(q, kv_layer, tables, lens, qsl, qsl_cpu, chunk,
                                          scale, sliding_window, tile=tile)

        return _timer(launch, kv_layer.device, reps)

    return time_fn


@dataclass(frozen=True)
class AttentionTables:
    """The tuned tables the Triton backend takes (`TritonBackend.decode_table`,
    `.prefill_table`)."""

    decode: TileTable[DecodeTile]
    prefill: TileTable[PrefillTile]


def tune_attention(kv_layer: torch.Tensor, num_heads: int, dtype: torch.dtype,
                   sliding_window: int | None, max_num_seqs: int, max_model_len: int,
                   max_num_batched_tokens: int, budget_s: float = BUDGET_S,
                   reps: int = REPS, clock: Callable[[], float] = time.perf_counter,
                   time_fns: tuple[TimeFn, TimeFn] | None = None) -> AttentionTables:
    """Both kernels' tables for this rank's shape on its GPU (kv_layer: the cache's
    layer-0 view, whose shape, dtype and strides every layer shares), within
    `budget_s` seconds together: decode up to DECODE_SHARE of it, prefill the rest
    (what decode left included). `time_fns`: (decode, prefill) timing functions in
    place of the real timers on `kv_layer` (tests)."""
    start = clock()
    head_dim = kv_layer.shape[4]
    batches, contexts = grid_points(max_num_seqs, max_model_len)
    decode_fn, prefill_fn = time_fns or (
        decode_timer(kv_layer, num_heads, dtype, sliding_window, reps),
        prefill_timer(kv_layer, num_heads, dtype, sliding_window, reps))
    with torch.inference_mode():
        decode = tune_decode_table(batches, contexts, default_tile(head_dim), decode_fn,
                                   budget_s * DECODE_SHARE, clock)
        prefill = tune_prefill_table(chunk_points(max_num_batched_tokens, max_model_len),
                                     default_prefill_tile(head_dim), prefill_fn,
                                     max(0.0, start + budget_s - clock()), clock)
    return AttentionTables(decode, prefill)
