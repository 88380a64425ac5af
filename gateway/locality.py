"""The gateway's view of KV locality: Redis block index lookups (timed, counted) that
fill a RouteRequest, and the closed loop that learns per worker how far the index can
be trusted.

Closed loop: for the chosen worker the gateway predicts the prompt tokens it will not
recompute (its leading indexed blocks, capped as the engine caps prefix hits: the last
prompt token is always computed) and compares with the `num_cached_tokens` the worker
reports. Accuracy per request is min(p, a) / max(p, a) (1 when both are 0); its EWMA is
the worker's trust, the factor on its locality score (floored at `min_trust`).

Ownership: Locality owns its RedisBlockIndex (`close()`); metrics are borrowed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine.block_hash import BlockHash
from gateway.metrics import GatewayMetrics
from gateway.routing.base import RouteRequest
from kvtransfer.index import IndexLookup, RedisBlockIndex

log = logging.getLogger(__name__)


class Locality:
    def __init__(self, index: RedisBlockIndex | None, metrics: GatewayMetrics,
                 alpha: float = 0.2, min_trust: float = 0.1) -> None:
        if not 0 < alpha <= 1 or not 0 <= min_trust <= 1:
            raise ValueError("need 0 < alpha <= 1 and 0 <= min_trust <= 1")
        self.index = index
        self.metrics = metrics
        self.alpha = alpha
        self.min_trust = min_trust
        self._accuracy: dict[str, float] = {}  # worker id -> EWMA of accuracy
        # worker id -> its floored accuracy, for the workers below 1: one the index never
        # misled is left out (RouteRequest.locality_trust reads a missing worker as 1),
        # so a request copies, and the scorer reads, only the workers it misled
        self._trust: dict[str, float] = {}
        self._children: dict[str, tuple[Any, Any, Any]] = {}  # worker id -> its metrics
        self._lookups: dict[str, Any] = {}  # lookup result -> its counter
        self._errors_seen = 0

    async def lookup(self, hashes: Sequence[BlockHash], nodes: set[str]) -> IndexLookup | None:
        """None: no index, or it is unavailable (routing uses load only)."""
        if self.index is None:
            return None
        if not hashes:
            return IndexLookup(0, {})
        t0 = time.perf_counter()
        res = await self.index.lookup(hashes, nodes)
        self.metrics.index_latency.observe(time.perf_counter() - t0)
        errors = self.index.errors
        if errors > self._errors_seen:
            self.metrics.index_errors.inc(errors - self._errors_seen)
            self._errors_seen = errors
        result = "unavailable" if res is None else "hit" if res.nodes else "miss"
        counter = self._lookups.get(result)
        if counter is None:  # labels() looks the child up under a lock: once per result
            counter = self._lookups[result] = self.metrics.index_lookups.labels(result)
        counter.inc()
        return res

    def fill(self, req: RouteRequest, lookup: IndexLookup | None) -> RouteRequest:
        """The request with its locality fields set from `lookup` (as is when None): its
        holders are the lookup's own mapping (neither changes it), the trust a copy."""
        if lookup is None:
            return req
        return replace(req, locality=lookup.nodes, indexed_blocks=lookup.num_blocks,
                       locality_trust=dict(self._trust))

    def trust(self, worker_id: str) -> float:
        return max(self.min_trust, self._accuracy.get(worker_id, 1.0))

    def observe(self, worker_id: str, predicted: int, actual: int) -> None:
        """A worker's first response: what it really had cached vs our prediction."""
        hi = max(predicted, actual)
        accuracy = 1.0 if hi == 0 else min(predicted, actual) / hi
        prev = self._accuracy.get(worker_id, 1.0)
        ewma = (1 - self.alpha) * prev + self.alpha * accuracy
        self._accuracy[worker_id] = ewma
        if (trust := self.trust(worker_id)) < 1.0:
            self._trust[worker_id] = trust
        else:
            self._trust.pop(worker_id, None)
        children = self._children.get(worker_id)
        if children is None:  # labels() looks the child up under a lock: once per worker
            m = self.metrics
            children = self._children[worker_id] = (
                m.predicted_cached.labels(worker_id), m.actual_cached.labels(worker_id),
                m.index_accuracy.labels(worker_id))
        children[0].inc(predicted)
        children[1].inc(actual)
        children[2].set(ewma)
        if accuracy < 0.5:
            log.info("event=index_mispredict worker=%s predicted=%d actual=%d trust=%.2f",
                     worker_id, predicted, actual, self.trust(worker_id))

    async def close(self) -> None:
        if self.index is not None:
            await self.index.close()
