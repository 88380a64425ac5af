"""The `prefix_locality` scorer: prefer the worker that already holds the prompt's
leading KV blocks, weighted by where it holds them.

For a candidate holding the first k of the prompt's n full blocks with tiers t_1..t_k,
and K >= k leading blocks held by some node of the cluster (fetchable from a peer):

    score = trust * (sum_i w[t_i] + (K - k) * w["peer"]) / (n * max(w))

so a worker holding the whole prompt on device scores `trust`, and one holding nothing
scores only what peers could give it (trust scales what the index says a worker
holds; it does not touch what peers could give). `trust` is the closed loop's per-worker figure
(gateway/locality.py). With no index data every candidate scores 0 (routing falls back
to the other scorers).
"""

from __future__ import annotations

import itertools
import logging
import operator
from typing import Any

import numpy as np

from gateway.routing.base import SCORERS, CandidateSet, RouteRequest, clamp01
from kvtransfer.index import check_tier

log = logging.getLogger(__name__)

# device > host > disk > peer; "other": a tier not named here (e.g. an LMCache tier)
DEFAULT_TIER_WEIGHTS = {"device": 1.0, "host": 0.8, "disk": 0.5, "peer": 0.2, "other": 0.4}


class PrefixLocalityScorer:
    def __init__(self, tiers: dict[str, Any] | None = None) -> None:
        if tiers is not None and not isinstance(tiers, dict):
            raise ValueError(f"tiers must be a mapping of tier -> weight, got {tiers!r}")
        weights = dict(DEFAULT_TIER_WEIGHTS)
        for tier, w in (tiers or {}).items():
            check_tier(str(tier))
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 1:
                raise ValueError(f"tier weight for {tier!r} must be a number in [0, 1], "
                                 f"got {w!r}")
            weights[str(tier)] = float(w)
        if max(weights.values()) <= 0:
            raise ValueError("tier weights must not all be 0")
        self.weights = weights
        self._norm = max(weights.values())

    def options(self) -> dict[str, Any]:
        return {"tiers": dict(self.weights)}

    def score(self, req: RouteRequest, candidates: CandidateSet) -> np.ndarray:
        n = len(req.block_hashes)
        if n == 0 or req.indexed_blocks == 0:
            log.debug("prefix_locality: no indexed prefix for %s; scoring 0", req.request_id)
            return np.zeros(len(candidates))
        peer = self.weights["peer"]
        scale = n * self._norm
        none = req.indexed_blocks * peer  # what a worker holding nothing gets from peers
        out = np.full(len(candidates), min(1.0, max(0.0, none / scale)))
        locality = req.locality
        if not locality:
            return out
        # Per holder at C speed: its row, its run's total, its trust. The holders' runs
        # repeat (a shared prefix): a total per stretch of one object, once per distinct
        # value (hashing a long tuple is what the stretches spare).
        rows = candidates.rows_of(locality.keys())
        runs = list(locality.values())
        # One run for all? list.count checks identity first (one object costs no
        # compares), then compares item by item: holders of one prefix to different
        # depths hold runs equal up to the shorter one's end, each a compare as long as
        # it. The last run unlike the first (one compare) skips it.
        if runs[-1] == runs[0] and runs.count(runs[0]) == len(runs):
            starts = [0]
        else:
            starts = [0, *itertools.compress(itertools.count(1),
                                             map(operator.is_not, runs[1:], runs))]
        ends = [*starts[1:], len(runs)]
        by_value: dict[tuple[str, ...], float] = {}  # a Redis lookup's: a tuple per node
        other = itertools.repeat(self.weights["other"])
        totals = []
        for a in starts:
            tiers = runs[a]
            s = by_value.get(tiers)
            if s is None:
                s = by_value[tiers] = sum(map(self.weights.get, tiers, other))
            totals.append(s + max(0, req.indexed_blocks - len(tiers)) * peer)
        total: np.ndarray | float
        if totals.count(totals[0]) == len(totals):  # the same elementwise arithmetic as
            total = totals[0]                       # an array of it
        else:
            total = np.repeat(totals, [b - a for a, b in zip(starts, ends, strict=True)])
        held = rows >= 0
        at = rows[held]
        if isinstance(total, np.ndarray):
            total = total[held]
        trust: np.ndarray | float = 1.0  # no worker misled (x * 1.0 is x, to the bit)
        if misled := req.locality_trust:  # per candidate row, then the holders' rows
            per_row = np.ones(len(candidates))
            where = candidates.rows_of(misled.keys())
            known = where >= 0
            per_row[where[known]] = np.fromiter(misled.values(), np.float64,
                                                len(misled))[known]
            trust = per_row[at]
        out[at] = clamp01(np.asarray(trust * total / scale))  # one for all when both are
        return out


SCORERS.register("prefix_locality")(PrefixLocalityScorer)
