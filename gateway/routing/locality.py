"""The `prefix_locality` scorer: prefer the worker that already holds the prompt's
leading KV blocks, weighted by where it holds them.

For a candidate holding the first k of the prompt's n full blocks with tiers t_1..t_k,
and K >= k leading blocks held by some node of the cluster (fetchable from a peer):

    score = trust * (sum_i w[t_i] + (K - k) * w["peer"]) / (n * max(w))

so a worker holding the whole prompt on device scores `trust`, and one holding nothing
scores only what peers could give it. `trust` is the closed loop's per-worker figure
(gateway/locality.py). With no index data every candidate scores 0 (routing falls back
to the other scorers).
"""

from __future__ import annotations

import logging
from typing import Any

from gateway.routing.base import SCORERS, Candidate, RouteRequest
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

    def _weight(self, tier: str) -> float:
        return self.weights.get(tier, self.weights["other"])

    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        n = len(req.block_hashes)
        if n == 0 or req.indexed_blocks == 0:
            log.debug("prefix_locality: no indexed prefix for %s; scoring 0", req.request_id)
            return [0.0] * len(candidates)
        peer = self.weights["peer"]
        scale = n * self._norm
        locality, trusts = req.locality, req.locality_trust
        # At scale most candidates hold nothing (they score what peers could give them,
        # all alike) and the holders' runs repeat (a shared prefix): one sum per run.
        none = req.indexed_blocks * peer
        out = [min(1.0, max(0.0, none / scale))] * len(candidates)
        totals: dict[tuple[str, ...], float] = {}
        by_id: dict[int, float] = {}  # the same run object again (the runs live till we return)
        for i, c in enumerate(candidates):
            tiers = locality.get(c.worker_id)
            if tiers is None:
                if c.worker_id in trusts:
                    out[i] = min(1.0, max(0.0, trusts[c.worker_id] * none / scale))
                continue
            total = by_id.get(id(tiers))
            if total is None:
                total = totals.get(tiers)
                if total is None:
                    total = sum(self._weight(t) for t in tiers)
                    total += max(0, req.indexed_blocks - len(tiers)) * peer
                    totals[tiers] = total
                by_id[id(tiers)] = total
            x = trusts.get(c.worker_id, 1.0) * total / scale
            out[i] = x if 0.0 <= x <= 1.0 else min(1.0, max(0.0, x))  # clamped, NaN -> 0
        return out


SCORERS.register("prefix_locality")(PrefixLocalityScorer)
