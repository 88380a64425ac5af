"""Start-up tuning of split-K decode (engine.attention.triton_attn): for this rank's
shape (heads, KV heads, head dim, block size, compute and cache dtype, window), a few
representative (batch, context) points each get the fastest of a small set of launch
configurations (`DecodeTile`), timed with CUDA events on the engine's own KV cache.
The result is a table the Triton backend looks up from host ints on every decode
launch, so it is decided before CUDA graphs are captured and each graph keeps its
bucket's choice.

Every candidate computes the same attention (tiles, warps, stages and split count
change the order of work, not what is summed), so tuning changes speed only. It is
bounded: a coordinate search (tile x warps, then stages, then the split rule), a
couple of timed launches per candidate and a wall-clock budget, past which the
remaining points keep the untuned configuration.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import triton

from engine.attention import triton_attn
from engine.attention.triton_attn import DecodeTile

logger = logging.getLogger(__name__)

TUNING_MODES = ("auto", "off")
BATCH_POINTS = (1, 8, 32, 128)
CONTEXT_POINTS = (1024, 8192)
TILE_NS = (32, 64, 128)
WARPS = (2, 4, 8)
STAGES = (1, 2, 3)
WAVES = (1, 2, 4)
BUDGET_S = 10.0
REPS = 3

# time_fn(tile, batch, context) -> seconds per launch; it may raise (a configuration
# that does not compile or fit on this GPU), which rules the candidate out.
TimeFn = Callable[[DecodeTile, int, int], float]


def _bucket(points: Sequence[int], value: int) -> int:
    """The smallest point >= value, else the largest (points ascending)."""
    return next((p for p in points if p >= value), points[-1])


@dataclass(frozen=True)
class DecodeTable:
    """Tuned tiles on a (batch, context) grid. A step of `num_seqs` sequences, the
    longest `max_seq_len` tokens, takes the entry of the smallest grid point covering
    both (the largest where none does); a point without an entry, or an empty table,
    gives the untuned DecodeTile(). A CUDA graph's metadata bounds its sequences at
    the model's length, so a graph takes its batch size's longest-context entry."""

    batches: tuple[int, ...] = ()
    contexts: tuple[int, ...] = ()
    entries: dict[tuple[int, int], DecodeTile] = field(default_factory=dict)

    def choose(self, num_seqs: int, max_seq_len: int) -> DecodeTile:
        if not self.entries:
            return DecodeTile()
        key = (_bucket(self.batches, num_seqs), _bucket(self.contexts, max_seq_len))
        return self.entries.get(key, DecodeTile())

    def describe(self) -> str:
        return "; ".join(f"batch<={b} ctx<={c}: tile {t.tile_n} warps {t.num_warps} "
                         f"stages {t.num_stages} waves {t.waves}"
                         for (b, c), t in sorted(self.entries.items()))


def grid_points(max_num_seqs: int, max_model_len: int) -> tuple[tuple[int, ...],
                                                                 tuple[int, ...]]:
    """The batch and context points to tune, clipped to what the engine can run."""
    batches = tuple(sorted({min(b, max_num_seqs) for b in BATCH_POINTS}))
    contexts = tuple(sorted({min(c, max_model_len) for c in CONTEXT_POINTS}))
    return batches, contexts


def default_tile(head_dim: int) -> DecodeTile:
    """The untuned configuration, spelled out (triton_attn._tile_n on CUDA)."""
    return DecodeTile(tile_n=64 if head_dim <= 128 else 32)


def search(batch: int, context: int, base: DecodeTile, time_fn: TimeFn,
           deadline: float, clock: Callable[[], float] = time.perf_counter
           ) -> tuple[DecodeTile, float, float]:
    """The fastest tile for one point: (tile, its seconds, the base tile's seconds).
    Tile size x warps at the base's stages and waves, then the stages, then the split
    rule's waves, each around the best so far; ties keep the earlier candidate. Past
    `deadline` (a clock() value) the best found so far stands."""
    times: dict[DecodeTile, float] = {}

    def timed(tile: DecodeTile) -> float:
        if tile not in times:
            try:
                times[tile] = time_fn(tile, batch, context)
            except Exception as e:  # noqa: BLE001 - a candidate this GPU cannot run
                logger.debug("attention tuning: %s ruled out at batch %d ctx %d: %s",
                             tile, batch, context, e)
                times[tile] = math.inf
        return times[tile]

    best, best_t = base, timed(base)
    rounds: list[Callable[[DecodeTile], list[DecodeTile]]] = [
        lambda b: [DecodeTile(n, w, b.num_stages, b.waves) for n in TILE_NS for w in WARPS],
        lambda b: [DecodeTile(b.tile_n, b.num_warps, s, b.waves) for s in STAGES],
        lambda b: [DecodeTile(b.tile_n, b.num_warps, b.num_stages, v) for v in WAVES],
    ]
    for make in rounds:
        for tile in make(best):
            if clock() > deadline:
                return best, best_t, times[base]
            t = timed(tile)
            if t < best_t:
                best, best_t = tile, t
    return best, best_t, times[base]


def tune_table(batches: Sequence[int], contexts: Sequence[int], base: DecodeTile,
               time_fn: TimeFn, budget_s: float = BUDGET_S,
               clock: Callable[[], float] = time.perf_counter) -> DecodeTable:
    """Searches every (batch, context) point within `budget_s` seconds in all; points
    not reached keep no entry (the untuned tile). Logs the table at INFO."""
    start = clock()
    deadline = start + budget_s
    entries: dict[tuple[int, int], DecodeTile] = {}
    notes = []
    for b in batches:
        for c in contexts:
            if clock() > deadline:
                break
            tile, t, t_base = search(b, c, base, time_fn, deadline, clock)
            if math.isfinite(t):
                entries[(b, c)] = tile
                notes.append(f"batch {b} ctx {c}: {t * 1e6:.1f} us "
                             f"(untuned {t_base * 1e6:.1f} us)")
    table = DecodeTable(tuple(batches), tuple(contexts), entries)
    missed = len(batches) * len(contexts) - len(entries)
    logger.info("attention tuning: %d points in %.1f s%s: %s [%s]", len(entries),
                clock() - start, f", {missed} untuned (budget)" if missed else "",
                table.describe() or "untuned", "; ".join(notes))
    return table


def decode_timer(kv_layer: torch.Tensor, num_heads: int, dtype: torch.dtype,
                 sliding_window: int | None, reps: int = REPS, seed: int = 0) -> TimeFn:
    """Times decode_attention on `kv_layer` (a layer's view of the engine's cache;
    only read) for `batch` sequences of `context` tokens each, their blocks drawn at
    random from the pool: one untimed launch (it compiles), then `reps` launches
    between two CUDA events (off CUDA, the interpreter: the host's clock)."""
    device = kv_layer.device
    block_size, head_dim = kv_layer.shape[2], kv_layer.shape[4]
    gen = torch.Generator().manual_seed(seed)
    inputs: dict[tuple[int, int], tuple] = {}

    def make(batch: int, context: int) -> tuple:
        width = triton.cdiv(context, block_size)
        tables = torch.randint(0, kv_layer.shape[0], (batch, width), generator=gen,
                               dtype=torch.int32).to(device)
        q = torch.randn((batch, num_heads, head_dim), generator=gen).to(dtype).to(device)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        qsl_cpu = list(range(batch + 1))
        qsl = torch.tensor(qsl_cpu, dtype=torch.int32, device=device)
        return q, tables, lens, qsl, qsl_cpu

    def time_fn(tile: DecodeTile, batch: int, context: int) -> float:
        if (batch, context) not in inputs:
            inputs[(batch, context)] = make(batch, context)
        q, tables, lens, qsl, qsl_cpu = inputs[(batch, context)]

        def launch() -> None:
            triton_attn.decode_attention(q, kv_layer, tables, lens, qsl, qsl_cpu,
                                         head_dim ** -0.5, sliding_window, tile=tile)

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

    return time_fn


def tune_decode(kv_layer: torch.Tensor, num_heads: int, dtype: torch.dtype,
                sliding_window: int | None, max_num_seqs: int, max_model_len: int,
                budget_s: float = BUDGET_S, reps: int = REPS) -> DecodeTable:
    """The decode table for this rank's shape on its GPU (kv_layer: the cache's
    layer-0 view, whose shape, dtype and strides every layer shares)."""
    batches, contexts = grid_points(max_num_seqs, max_model_len)
    with torch.inference_mode():
        return tune_table(batches, contexts, default_tile(kv_layer.shape[4]),
                          decode_timer(kv_layer, num_heads, dtype, sliding_window, reps),
                          budget_s)
