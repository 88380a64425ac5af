"""Prometheus metrics of the transports (no module-level registry).

The metric families of one registry are made once and shared by every transport
instance exposed there (a decode worker has a receiver and a sender: one
`splitserve:kv_transfer_bytes` family, told apart by the `role` label).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

# Transfers range from one 16 KiB region to GiBs; seconds buckets cover both.
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0)
# Per transfer: one request's hand-off is one 16 KiB block to a long prompt's GiBs.
_BYTES_BUCKETS = tuple(float(1 << n) for n in range(14, 35, 2))  # 16 KiB .. 16 GiB
_LABELS = ("role", "transport")


@dataclass(frozen=True, slots=True)
class _Families:
    bytes: Counter
    seconds: Histogram
    transfer_bytes: Histogram
    failures: Counter
    stale_dropped: Counter
    refused: Counter


# A cache keyed by registry (weakly: it goes with its registry), not shared state:
# registering a family twice in one registry is an error in prometheus_client.
_FAMILIES: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = \
    weakref.WeakKeyDictionary()


def _families(registry: CollectorRegistry) -> _Families:
    fam = _FAMILIES.get(registry)
    if fam is None:
        fam = _FAMILIES[registry] = _Families(
            bytes=Counter("splitserve:kv_transfer_bytes", "KV bytes moved", _LABELS,
                          registry=registry),
            seconds=Histogram("splitserve:kv_transfer_seconds",
                              "Seconds from expect/first write to completion", _LABELS,
                              buckets=_SECONDS_BUCKETS, registry=registry),
            transfer_bytes=Histogram(
                "splitserve:kv_transfer_request_bytes",
                "Bytes of each completed transfer (one request's hand-off or one peer "
                "fetch)", _LABELS, buckets=_BYTES_BUCKETS, registry=registry),
            failures=Counter("splitserve:kv_transfer_failures", "Failed transfers by kind",
                             (*_LABELS, "kind"), registry=registry),
            stale_dropped=Counter(
                "splitserve:kv_transfer_stale_writes_dropped",
                "Writes dropped because their transfer was fenced or unknown", _LABELS,
                registry=registry),
            refused=Counter("splitserve:kv_transfer_handshakes_refused",
                            "Connections refused at handshake", (*_LABELS, "reason"),
                            registry=registry))
    return fam


class TransferMetrics:
    """Counters for one side of one transport; pass a registry to expose them."""

    def __init__(self, role: str, transport: str,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._labels = {"role": role, "transport": transport}
        self._fam = _families(self.registry)
        self.bytes = self._fam.bytes.labels(**self._labels)
        self.seconds = self._fam.seconds.labels(**self._labels)
        self.transfer_bytes = self._fam.transfer_bytes.labels(**self._labels)
        self.stale_dropped = self._fam.stale_dropped.labels(**self._labels)

    def completed(self, seconds: float, nbytes: int) -> None:
        """One transfer done: its time and its bytes, each a histogram observation."""
        self.seconds.observe(seconds)
        self.transfer_bytes.observe(nbytes)

    def failure(self, kind: str) -> None:
        self._fam.failures.labels(kind=kind, **self._labels).inc()

    def refused(self, reason: str) -> None:
        self._fam.refused.labels(reason=reason, **self._labels).inc()

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (tests and the benchmark read metrics this way)."""
        got = self.registry.get_sample_value(name, {**self._labels, **labels})
        return 0.0 if got is None else got
