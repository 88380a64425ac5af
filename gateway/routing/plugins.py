"""The routing plugins of issue 4: readiness/role filter, queue-depth and KV-usage
scorers, `max_score`, `power_of_two` and `round_robin` pickers, the `threshold` decider."""

from __future__ import annotations

import logging
import random

import numpy as np

from gateway.routing.base import (
    DECIDERS,
    FILTERS,
    PICKERS,
    SCORERS,
    Candidate,
    CandidateSet,
    RouteRequest,
    clamp01,
)

log = logging.getLogger(__name__)

DECODE_ROLES = ("decode", "colocated")


class ReadyRoleFilter:
    """Keeps ready workers whose role is one of `roles`."""

    def __init__(self, roles: tuple[str, ...] = DECODE_ROLES) -> None:
        self.roles = tuple(roles)

    def filter(self, req: RouteRequest, candidates: CandidateSet) -> CandidateSet:
        return candidates.ready_in(self.roles)


def _min_max_inverse(values: np.ndarray) -> np.ndarray:
    """Lowest value -> 1, highest -> 0, linear between; all equal -> all 1."""
    if not len(values):
        return values
    lo, hi = values.min(), values.max()
    if hi == lo:
        return np.ones(len(values))
    return 1.0 - (values - lo) / (hi - lo)


class QueueDepthScorer:
    """Fewer queued + in-flight requests scores higher (min-max across candidates). A
    worker's running count is the larger of its report and this gateway's in-flight
    count (fresher than reports)."""

    def score(self, req: RouteRequest, candidates: CandidateSet) -> np.ndarray:
        return _min_max_inverse((candidates.num_waiting + np.maximum(
            candidates.inflight, candidates.num_running)).astype(np.float64))


class KVUsageScorer:
    """More free KV cache scores higher: 1 - usage. No report yet: 0 (and a log)."""

    def score(self, req: RouteRequest, candidates: CandidateSet) -> np.ndarray:
        reported = candidates.num_blocks > 0
        if reported.all():
            return clamp01(1.0 - candidates.kv_usage)
        log.debug("kv_usage scorer: no report yet from %s; scoring 0",
                  [w for w, ok in zip(candidates.ids, reported.tolist(), strict=True) if not ok])
        return np.where(reported, clamp01(1.0 - candidates.kv_usage), 0.0)


class MaxScorePicker:
    """The best score; ties broken at random (so equal workers share the load)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, candidates: CandidateSet, scores: np.ndarray) -> Candidate:
        if not len(candidates):
            raise ValueError("no candidates to pick from")
        best = np.flatnonzero(scores >= scores.max() - 1e-12)
        return candidates[int(self._rng.choice(best))]


class PowerOfTwoPicker:
    """Two candidates at random, the better of them (Mitzenmacher's two choices)."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(self, candidates: CandidateSet, scores: np.ndarray) -> Candidate:
        if not len(candidates):
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

    def pick(self, candidates: CandidateSet, scores: np.ndarray) -> Candidate:
        if not len(candidates):
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

    def decide(self, req: RouteRequest, decode: Candidate, prefill_candidates: CandidateSet,
               cached_tokens: int) -> bool:
        if not len(prefill_candidates):
            return False
        return len(req.prompt_token_ids) - cached_tokens > self.threshold


FILTERS.register("ready_role")(ReadyRoleFilter)
SCORERS.register("queue")(QueueDepthScorer)
SCORERS.register("kv_usage")(KVUsageScorer)
PICKERS.register("max_score")(MaxScorePicker)
PICKERS.register("power_of_two")(PowerOfTwoPicker)
PICKERS.register("round_robin")(RoundRobinPicker)
DECIDERS.register("threshold")(ThresholdDecider)
