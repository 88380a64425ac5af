"""The gateway's Prometheus metrics (own CollectorRegistry; `splitserve:` names), and the
pool-level load series an endpoint picker scores a gateway pod on.

Token counts and request latencies the workers also export under vLLM's names are the
gateway's own view here, named `splitserve:gateway_*`: a sum of `vllm:*` over every pod
counts each token once (the decode or colocated worker's count)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.routing.base import Candidate

SERVING_ROLES = ("decode", "colocated")  # where a request's KV lives while it decodes
TTFT_PARTS = ("queue", "route", "worker_queue", "prefill", "kv_transfer")


class PoolLoad(Collector):
    """`vllm:num_requests_waiting`, `vllm:num_requests_running` and
    `vllm:kv_cache_usage_perc` of the pool this gateway routes to, read at scrape time:
    the Gateway API Inference Extension's endpoint picker scores the pool's members (the
    gateway pods) on these. Waiting counts this gateway's admission queue too. They are
    the workers' own figures summed, so a sum over pods must select gateway pods or
    worker pods, not both."""

    def __init__(self, model: str, candidates: Callable[[], Sequence[Candidate]],
                 admission_waiting: Callable[[], int]) -> None:
        self._model = model
        self._candidates = candidates
        self._admission_waiting = admission_waiting

    def collect(self) -> Iterator[Metric]:
        workers = self._candidates()
        serving = [c for c in workers if c.role in SERVING_ROLES]
        blocks = sum(c.num_blocks for c in serving)
        used = sum(c.num_blocks - c.num_free_blocks for c in serving)
        for name, doc, value in (
                ("vllm:num_requests_waiting", "Requests waiting: this gateway's admission "
                 "queue and its workers' queues", self._admission_waiting()
                 + sum(c.num_waiting for c in workers)),
                ("vllm:num_requests_running", "Requests running on this gateway's workers",
                 sum(c.num_running for c in workers)),
                ("vllm:kv_cache_usage_perc", "KV blocks in use over the decode and "
                 "colocated workers' pools (0-1)", used / blocks if blocks else 0.0)):
            fam = GaugeMetricFamily(name, doc, labels=["model_name"])
            fam.add_metric([self._model], float(value))
            yield fam


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("splitserve:gateway_requests", "Requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.rejected = Counter("splitserve:gateway_rejected", "Requests refused before routing",
                                ["reason", "tenant"], registry=r)
        self.routed = Counter("splitserve:routing_decisions", "Routing decisions",
                              ["worker", "prefill"], registry=r)
        self.failovers = Counter(
            "splitserve:gateway_failovers", "Streams whose worker failed mid-request, by "
            "outcome (resumed on another worker, exhausted, refused_n)", ["outcome"],
            registry=r)
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
        self.e2e = Histogram("splitserve:gateway_e2e_request_latency_seconds", "End-to-end latency",
                             ["model_name"], registry=r,
                             buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        # Per tenant (gateway/identity.py): what the admission queue shares out.
        self.queue_time = Histogram(
            "splitserve:gateway_request_queue_time_seconds", "Time waiting in the gateway's admission queue",
            ["model_name", "tenant"], registry=r,
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.ttft = Histogram("splitserve:gateway_time_to_first_token_seconds",
                              "Arrival at the gateway to the first token", ["model_name", "tenant"],
                              registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                                                   10, 30, 60))
        # The first token's time by part: the figures of the x-splitserve-ttft header,
        # observed for every request (the header itself only when a request asks).
        self.ttft_part = Histogram(
            "splitserve:gateway_ttft_part_seconds", "Time to first token by part (queue: "
            "admission queue, route: routing decision, worker_queue, prefill, kv_transfer: "
            "remote fill, other: network, gRPC and the gateway's own work)",
            ["model_name", "part"], registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                     5, 10, 30, 60))
        self.prompt_tokens = Counter("splitserve:gateway_prompt_tokens", "Prompt tokens dispatched",
                                     ["model_name", "tenant"], registry=r)
        self.generation_tokens = Counter("splitserve:gateway_generation_tokens", "Tokens generated",
                                         ["model_name", "tenant"], registry=r)
        self.admission_waiting = Gauge("splitserve:gateway_requests_waiting",
                                       "Requests in the gateway's admission queue", registry=r)
        self.strategies_version = Gauge("splitserve:scheduling_strategies_version",
                                        "Version of the scheduling strategies in force",
                                        registry=r)

    def observe_ttft_parts(self, model: str, ttft: dict[str, float]) -> None:
        """One request's first-token breakdown (GenerateInput.ttft, in seconds): each
        part present, and `other`, the total less the parts."""
        total = ttft.get("total")
        if total is None:
            return
        parts = {k: v for k, v in ttft.items() if k in TTFT_PARTS}
        for part, seconds in parts.items():
            self.ttft_part.labels(model, part).observe(seconds)
        self.ttft_part.labels(model, "other").observe(max(total - sum(parts.values()), 0.0))

    def watch_pool(self, model: str, candidates: Callable[[], Sequence[Candidate]],
                   admission_waiting: Callable[[], int]) -> None:
        """Exports the pool's load (PoolLoad) from the registry's candidates."""
        self.registry.register(PoolLoad(model, candidates, admission_waiting))
