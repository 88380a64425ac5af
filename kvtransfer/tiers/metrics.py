"""Prometheus view of a TieredCache's figures, read at scrape time (no torch import).

    splitserve:tier_hits_total{tier}              blocks loaded from the tier
    splitserve:tier_bytes_total{tier,direction}   bytes loaded ("load") / stored ("store")
    splitserve:tier_evictions_total{tier}         blocks evicted (demoted or dropped)
    splitserve:tier_blocks{tier}                  blocks held now
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class TierCollector:
    """`stats()` returns a manager.TierStats (or None before the cache exists)."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:
            return
        hits = CounterMetricFamily("splitserve:tier_hits", "KV blocks loaded from an "
                                   "offload tier", labels=["tier"])
        for tier, n in sorted(s.hits.items()):
            hits.add_metric([tier], float(n))
        yield hits
        moved = CounterMetricFamily("splitserve:tier_bytes", "KV bytes moved per offload "
                                    "tier", labels=["tier", "direction"])
        for direction, table in (("load", s.bytes_loaded), ("store", s.bytes_stored)):
            for tier, n in sorted(table.items()):
                moved.add_metric([tier, direction], float(n))
        yield moved
        ev = CounterMetricFamily("splitserve:tier_evictions", "KV blocks evicted from an "
                                 "offload tier", labels=["tier"])
        for tier, n in sorted(s.evictions.items()):
            ev.add_metric([tier], float(n))
        yield ev
        held = GaugeMetricFamily("splitserve:tier_blocks", "KV blocks held per offload tier",
                                 labels=["tier"])
        for tier, n in sorted(s.blocks.items()):
            held.add_metric([tier], float(n))
        yield held
