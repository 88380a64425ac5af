"""Prometheus metrics of one transport instance (no module-level registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# Transfers range from one 16 KiB region to GiBs; seconds buckets cover both.
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0)


class TransferMetrics:
    """Counters for one side of one transport; pass a registry to expose them."""

    def __init__(self, role: str, transport: str,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ("role", "transport")
        self._labels = {"role": role, "transport": transport}
        self.bytes = Counter("splitserve:kv_transfer_bytes", "KV bytes moved", labels,
                             registry=self.registry).labels(**self._labels)
        self.seconds = Histogram("splitserve:kv_transfer_seconds",
                                 "Seconds from expect/first write to completion", labels,
                                 buckets=_SECONDS_BUCKETS,
                                 registry=self.registry).labels(**self._labels)
        self._failures = Counter("splitserve:kv_transfer_failures", "Failed transfers by kind",
                                 (*labels, "kind"), registry=self.registry)
        self.stale_dropped = Counter(
            "splitserve:kv_transfer_stale_writes_dropped",
            "Writes dropped because their transfer was fenced or unknown", labels,
            registry=self.registry).labels(**self._labels)
        self._refused = Counter("splitserve:kv_transfer_handshakes_refused",
                                "Connections refused at handshake", (*labels, "reason"),
                                registry=self.registry)

    def failure(self, kind: str) -> None:
        self._failures.labels(kind=kind, **self._labels).inc()

    def refused(self, reason: str) -> None:
        self._refused.labels(reason=reason, **self._labels).inc()

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (tests and the benchmark read metrics this way)."""
        got = self.registry.get_sample_value(name, {**self._labels, **labels})
        return 0.0 if got is None else got
