"""The latency model that stands in for the forward pass: one engine step's time from
what the real scheduler scheduled, by the roofline of bench/engine_roofline.py (the
same FLOP and byte counts `bench engine` holds measured steps against) with the
profile's efficiency factors and fixed costs.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from bench.engine_roofline import ModelCost
from engine.config import ModelConfig
from engine.scheduler import ScheduledRequest
from sim.profile import HardwareProfile

INF: Final = float("inf")
# From this many iterations a walk runs as numpy arrays: the same float operations,
# element by element, and the running sums added one after the other (accumulate), so
# the same bits; below it the array calls cost more than the loop.
_ARRAY_WALK: Final = 48


class LatencyModel:
    def __init__(self, profile: HardwareProfile, model: ModelConfig | None = None) -> None:
        self.profile = profile
        cfg = model or profile.model_config()
        self.cost = ModelCost.from_config(cfg, profile.itemsize)
        p = profile
        # Seconds per unit, folded once: the hot path is a few multiplications.
        self._s_per_flop = 1.0 / (p.peak_flop_s * p.compute_efficiency)
        self._s_per_byte = 1.0 / (p.bandwidth_bytes_s * p.memory_efficiency)
        self._flop_token = 2 * self.cost.layer_params
        self._flop_sampled = 2 * self.cost.head_params
        self._flop_pair = self.cost.attn_flops_per_pair
        self._kv_token = self.cost.kv_bytes_per_token
        self._weights = self.cost.weight_bytes
        self._max = p.combine == "max"

    @property
    def kv_block_bytes(self) -> int:
        return self._kv_token * self.profile.block_size

    def seconds(self, tokens: int, sampled: int, pairs: int, kv_read: int,
                seqs: int) -> float:
        """One step computing `tokens` (of which `sampled` rows go through the lm_head),
        `pairs` causal (query, key) pairs, reading the weights once and `kv_read` cached
        tokens."""
        c = (tokens * self._flop_token + sampled * self._flop_sampled
             + pairs * self._flop_pair) * self._s_per_flop
        m = (self._weights + kv_read * self._kv_token) * self._s_per_byte
        p = self.profile
        return p.step_overhead_s + p.seq_overhead_s * seqs + (
            (c if c > m else m) if self._max else c + m)

    def parts(self, tokens: int, sampled: int, pairs: int, kv_read: int,
              seqs: int) -> tuple[float, float]:
        """`seconds`' step as (its FLOP time, the rest: fixed costs and memory traffic),
        which add up to it where the profile's terms add ("sum")."""
        c = (tokens * self._flop_token + sampled * self._flop_sampled
             + pairs * self._flop_pair) * self._s_per_flop
        m = (self._weights + kv_read * self._kv_token) * self._s_per_byte
        p = self.profile
        return c, p.step_overhead_s + p.seq_overhead_s * seqs + m

    def window_clock(self, computed: Sequence[int], start: float,
                     extra: float = 0.0) -> WindowClock:
        """The clock of a decode window of rows that have computed `computed` tokens,
        from `start` on, with `extra` added to each iteration's time."""
        return WindowClock(self, computed, start, extra)

    def step(self, scheduled: Sequence[ScheduledRequest]) -> float:
        """The step's time, read off the scheduler's output before it is applied: each
        row's chunk of new tokens in one pass, reading its KV once."""
        tokens = sampled = pairs = kv = 0
        for s in scheduled:
            r: Any = s.request  # a SimRequest: its token lists are counters
            n = s.num_new_tokens
            a = r.num_computed_tokens
            b = a + n
            tokens += n
            if b >= len(r.all_token_ids):
                sampled += 1
            pairs += (b * (b + 1) - a * (a + 1)) >> 1
            kv += b
        return self.seconds(tokens, sampled, pairs, kv, len(scheduled))


class WindowClock:
    """A decode window's iterations on the simulated clock. Iteration i (from 1) takes
    `dt(i)`: what `LatencyModel.step` gives it as a one-token step of every row, plus
    `extra`; it ends at `start + dt(1) + ... + dt(i)`, added one after the other as the
    one-iteration steps' clock adds them (the same float operations on the same
    numbers: to the bit). No list is kept per iteration: a question is one pass over
    the iterations it needs (`walk`; a window stands for ~200 iterations, and lists of
    their times cost more to make and free than the passes). A long walk's arrays are
    kept: a window's later questions (a cut, with the same busy time) are prefixes of
    its first, answered by a search in them."""

    _ends: Any = None  # a long walk's running sums (`_walk_arrays`): the ends,
    _busy: Any = None  # and the busy time from `_busy0`
    _busy0 = 0.0

    def __init__(self, model: LatencyModel, computed: Sequence[int], start: float,
                 extra: float) -> None:
        p = model.profile
        rows = len(computed)
        self.start = start
        self.rows = rows
        self.base = sum(computed)
        # seconds(rows, rows, pairs, pairs, rows) for each iteration, inlined
        self.fixed = p.step_overhead_s + p.seq_overhead_s * rows
        self.extra = extra
        self.flops = rows * model._flop_token + rows * model._flop_sampled
        self.flop_pair = model._flop_pair
        self.kv_token = model._kv_token
        self.weights = model._weights
        self.s_flop = model._s_per_flop
        self.s_byte = model._s_per_byte
        self.biggest = model._max

    def dt(self, i: int) -> float:
        """Iteration i's time."""
        pairs = self.base + self.rows * i
        c = (self.flops + pairs * self.flop_pair) * self.s_flop
        m = (self.weights + pairs * self.kv_token) * self.s_byte
        return self.fixed + ((c if c > m else m) if self.biggest else c + m) + self.extra

    def ends(self, n: int) -> list[float]:
        """When each of the first n iterations ends."""
        out: list[float] = []
        t = self.start
        for i in range(1, n + 1):
            t += self.dt(i)
            out.append(t)
        return out

    def walk(self, n: int, busy: float, now: float = INF,
             marks: list[int] | None = None) -> tuple[int, float, float, float, list[float]]:
        """Iterations 1, 2, ... up to the n-th, or to the first that ends at `now` or
        later (the one running then). Returns how many that is (i), when the i-th ends,
        when it started (the end of the one before; -inf for the first), `busy` plus
        their times (added as a worker's one-iteration steps add them to its busy
        time), and when each iteration in `marks` (nondecreasing, from 1, up to i)
        ends."""
        if self._ends is not None and n < len(self._ends) and busy == self._busy0:
            return self._search(n, now, marks or [])
        if n >= _ARRAY_WALK:
            return self._walk_arrays(n, busy, now, marks or [])
        base, rows, flops, flop_pair = self.base, self.rows, self.flops, self.flop_pair
        kv_token, weights, s_flop, s_byte = self.kv_token, self.weights, self.s_flop, self.s_byte
        fixed, extra, biggest = self.fixed, self.extra, self.biggest
        out: list[float] = []
        marks = marks or []
        j, left = 0, len(marks)
        mark = marks[0] if left else 0  # the next iteration asked for
        t = before = self.start
        i = 0
        while i < n:
            i += 1
            before = t
            pairs = base + rows * i  # the expression of `dt`, without a call
            c = (flops + pairs * flop_pair) * s_flop
            m = (weights + pairs * kv_token) * s_byte
            dt = fixed + ((c if c > m else m) if biggest else c + m) + extra
            t += dt
            busy += dt
            while i == mark:
                out.append(t)
                j += 1
                mark = marks[j] if j < left else 0
            if t >= now:
                break
        return i, t, before if i > 1 else -INF, busy, out

    def _walk_arrays(self, n: int, busy: float, now: float, marks: list[int]
                     ) -> tuple[int, float, float, float, list[float]]:
        """`walk` over arrays: each iteration's time as `dt` computes it (elementwise,
        in the same order), the ends and the busy time as running sums."""
        # In place, with fewer temporaries: x += a is a + x to the bit (IEEE addition
        # and multiplication commute), in the order `dt` computes. Row 0 of the arrays
        # is the running sums' seed (the start, the busy time), the i-th iteration's
        # time row i: no copy into arrays one longer.
        pairs = np.arange(self.base, self.base + self.rows * (n + 1), self.rows,
                          dtype=np.int64)
        c = (pairs * self.flop_pair + self.flops) * self.s_flop  # floats from here
        m = (pairs * self.kv_token + self.weights) * self.s_byte
        if self.biggest:
            np.maximum(c, m, out=c)
        else:
            c += m
        c += self.fixed
        c += self.extra
        b = c.copy()  # b[i]: busy + the first i's times
        c[0] = self.start  # t[i]: the i-th's end
        b[0] = busy
        t = np.add.accumulate(c, out=c)
        np.add.accumulate(b, out=b)
        self._ends, self._busy, self._busy0 = t, b, busy
        return self._search(n, now, marks)

    def _search(self, n: int, now: float, marks: list[int]
                ) -> tuple[int, float, float, float, list[float]]:
        """`walk` in the kept arrays (a prefix of a running sum is the running sum of
        the prefix)."""
        t = self._ends
        # the one running at `now`: the first to end at or after it (the ends increase)
        i = n if now == INF else min(n, int(np.searchsorted(t[1:n + 1], now, side="left")) + 1)
        out = t[marks[:bisect_right(marks, i)]].tolist() if marks else []
        return i, float(t[i]), float(t[i - 1]) if i > 1 else -INF, float(self._busy[i]), out

