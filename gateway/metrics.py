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
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end latency",
                             ["model_name"], registry=r,
                             buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
