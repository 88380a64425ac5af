"""The routing plugins of issue 4: readiness/role filter, queue-depth and KV-usage
scorers, `max_score`, `power_of_two` and `round_robin` pickers, the `threshold` decider."""

from __future__ import annotations

import logging
import random

from gateway.routing.base import (
    DECIDERS,
    FILTERS,
    PICKERS,
    SCORERS,
    Candidate,
    RouteRequest,
)

log = logging.getLogger(__name__)

DECODE_ROLES = ("decode", "colocated")


class ReadyRoleFilter:
    """Keeps ready workers whose role is one of `roles`."""

    def __init__(self, roles: tuple[str, ...] = DECODE_ROLES) -> None:
        self.roles = tuple(roles)

    def filter(self, req: RouteRequest, candidates: list[Candidate]) -> list[Candidate]:
        return [c for c in candidates if c.ready and c.role in self.roles]


def _min_max_inverse(values: list[float]) -> list[float]:
    """Lowest value -> 1, highest -> 0, linear between; all equal -> all 1."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    return [1.0 - (v - lo) / (hi - lo) for v in values]


class QueueDepthScorer:
    """Fewer queued + in-flight requests scores higher (min-max across candidates)."""

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        if not candidates:
            return []
        return _min_max_inverse([float(c.num_waiting + (c.inflight if c.inflight > c.num_running
                                                         else c.num_running))
                                 for c in candidates])


class KVUsageScorer:
    """More free KV cache scores higher: 1 - usage. No report yet: 0 (and a log)."""

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        out = []
        for c in candidates:
            if c.num_blocks <= 0:
                log.debug("kv_usage scorer: no report from %s yet; scoring 0", c.worker_id)
                out.append(0.0)
            else:
                free = 1.0 - c.kv_usage
                out.append(free if 0.0 <= free <= 1.0 else min(1.0, max(0.0, free)))
        return out


class MaxScorePicker:
    """The best score; ties broken at random (so equal workers share the load)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, candidates: list[Candidate], scores: list[float]) -> Candidate:
        if not candidates:
            raise ValueError("no candidates to pick from")
        best = max(scores)
        return self._rng.choice([c for c, s in zip(candidates, scores, strict=True)
                                 if s >= best - 1e-12])


class PowerOfTwoPicker:
    """Two candidates at random, the better of them (Mitzenmacher's two choices)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, candidates: list[Candidate], scores: list[float]) -> Candidate:
        if not candidates:
            raise ValueError("no candidates to pick from")
        if len(candidates) == 1:
            return candidates[0]
        i, j = self._rng.sample(range(len(candidates)), 2)
        return candidates[i] if scores[i] >= scores[j] else candidates[j]


class RoundRobinPicker:
    """Each candidate in turn (ordered by worker id), whatever the scores: the baseline
    that knows neither load nor cache. The rotation lives as long as the Router (a
    profile swap restarts it)."""

    def __init__(self, seed: int | None = None) -> None:
        self._next = 0  # `seed` is accepted for the PICKERS interface; nothing is random

    def pick(self, candidates: list[Candidate], scores: list[float]) -> Candidate:
        if not candidates:
            raise ValueError("no candidates to pick from")
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return chosen


class ThresholdDecider:
    """Remote prefill only when the prompt's part the decode does not hold is longer
    than `threshold` tokens, and a ready prefill worker exists."""

    def __init__(self, threshold: int = 256) -> None:
        if threshold < 0:
            raise ValueError("threshold must be >= 0")
        self.threshold = threshold

    def decide(self, req: RouteRequest, decode: Candidate,
               prefill_candidates: list[Candidate]) -> bool:
        if not prefill_candidates:
            return False
        uncached = len(req.prompt_token_ids) - req.cached_tokens.get(decode.worker_id, 0)
        return uncached > self.threshold


FILTERS.register("ready_role")(ReadyRoleFilter)
SCORERS.register("queue")(QueueDepthScorer)
SCORERS.register("kv_usage")(KVUsageScorer)
PICKERS.register("max_score")(MaxScorePicker)
PICKERS.register("power_of_two")(PowerOfTwoPicker)
PICKERS.register("round_robin")(RoundRobinPicker)
DECIDERS.register("threshold")(ThresholdDecider)
