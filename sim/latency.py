"""The latency model that stands in for the forward pass: one engine step's time from
what the real scheduler scheduled, by the roofline of bench/engine_roofline.py (the
same FLOP and byte counts `bench engine` holds measured steps against) with the
profile's efficiency factors and fixed costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.engine_roofline import ModelCost
from engine.config import ModelConfig
from engine.scheduler import ScheduledRequest
from sim.profile import HardwareProfile


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

    def window_times(self, computed: Sequence[int], k: int, start: float,
                     extra: float = 0.0) -> tuple[list[float], list[float]]:
        """A decode window's k iterations of rows that have computed `computed` tokens:
        their times (what `step` gives each as a one-token step, plus `extra` each) and
        when each ends, from `start` on, as the one-iteration steps' clock adds them."""
        rows, base = len(computed), sum(computed)
        # seconds(rows, rows, pairs, pairs, rows) for each iteration, inlined: the same
        # operations on the same numbers (exact ints, then the same float operations)
        p = self.profile
        fixed = p.step_overhead_s + p.seq_overhead_s * rows
        flops = rows * self._flop_token + rows * self._flop_sampled
        flop_pair, kv_token, weights = self._flop_pair, self._kv_token, self._weights
        s_flop, s_byte, biggest = self._s_per_flop, self._s_per_byte, self._max
        dts: list[float] = []
        ends: list[float] = []
        t = start
        for i in range(1, k + 1):
            pairs = base + rows * i
            c = (flops + pairs * flop_pair) * s_flop
            m = (weights + pairs * kv_token) * s_byte
            dt = fixed + ((c if c > m else m) if biggest else c + m) + extra
            dts.append(dt)
            t += dt
            ends.append(t)
        return dts, ends

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


def running_sum(total: float, dts: Sequence[float]) -> float:
    """`total` + dts[0] + dts[1] + ..., added one after the other as one-iteration steps
    add their times."""
    for dt in dts:
        total += dt
    return total
