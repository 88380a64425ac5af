"""The gateway's Prometheus metrics (own CollectorRegistry; `splitserve:` names)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("splitserve:gateway_requests", "Requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.rejected = Counter("splitserve:gateway_rejected", "Requests refused before routing",
                                ["reason"], registry=r)
        self.routed = Counter("splitserve:routing_decisions", "Routing decisions",
                              ["worker", "prefill"], registry=r)
        self.in_flight = Gauge("splitserve:gateway_requests_in_flight", "Requests in flight",
                               registry=r)
        self.decision_reasons = Counter(
            "splitserve:routing_decisions_by_reason",
            "Routing decisions by reason (prefix_hit: the chosen worker holds a prefix; "
            "load: no indexed prefix on it; index_unavailable: Redis down, load only)",
            ["reason"], registry=r)
        self.index_lookups = Counter("splitserve:index_lookups",
                                     "Block index lookups by result (hit, miss, unavailable)",
                                     ["result"], registry=r)
        self.index_errors = Counter("splitserve:index_errors",
                                    "Failed block index calls (timeouts, connection errors)",
                                    registry=r)
        self.index_latency = Histogram(
            "splitserve:index_lookup_seconds", "Block index lookup latency", registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25))
        self.predicted_cached = Counter("splitserve:predicted_cached_tokens",
                                        "Prompt tokens the index predicted cached on the "
                                        "chosen worker", ["worker"], registry=r)
        self.actual_cached = Counter("splitserve:actual_cached_tokens",
                                     "Prompt tokens the chosen worker reported cached",
                                     ["worker"], registry=r)
        self.index_accuracy = Gauge("splitserve:index_accuracy",
                                    "EWMA of predicted vs reported cached tokens (1 = exact); "
                                    "scales the worker's locality score", ["worker"],
                                    registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency",
                             ["model_name"], registry=r,
                             buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
