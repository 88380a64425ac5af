"""Prometheus metrics of one worker, with vLLM's names where the meaning is the same.

Each WorkerMetrics owns its CollectorRegistry (no process-global state). Load gauges
and prefix-cache counters are read from the engine's stats at scrape time; request
figures are observed by the Generate handler. Per-request families and preemptions
carry a `tenant` label (the request's tenant; "" when it has none).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.fairness import TenantServed
from engine.scheduler import SchedulerStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


class _StatsCollector(Collector):
    def __init__(self, model: str, stats: Callable[[], SchedulerStats | None]) -> None:
        self._model = model
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:  # model not loaded yet
            return
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests in the running batch", s.num_running),
                ("vllm:num_requests_waiting", "Requests waiting to be scheduled",
                 s.num_waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = full", s.kv_usage),
                ("splitserve:kv_free_blocks", "Free KV blocks", s.num_free_blocks),
                ("splitserve:kv_blocks", "KV blocks in the pool", s.num_blocks)):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], float(value))
            yield g
        for name, doc, value in (
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                 s.prefix_cache_queries),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                 s.prefix_cache_hits)):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self._model], float(value))
            yield c
        c = CounterMetricFamily("vllm:num_preemptions", "Preempted requests",
                                labels=["model_name", "tenant"])
        for tenant, served in sorted(s.tenants.items()) or [("", TenantServed())]:
            c.add_metric([self._model, tenant], float(served.preemptions))
        yield c
        g = GaugeMetricFamily("splitserve:scheduling_strategies_version",
                              "Version of the scheduling strategies applied (0: none)",
                              labels=["model_name"])
        g.add_metric([self._model], float(s.strategies_version))
        yield g


class WorkerMetrics:
    def __init__(self, model: str, stats: Callable[[], SchedulerStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        self.registry.register(_StatsCollector(model, stats))
        labels = ["model_name", "tenant"]
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Time waiting before first scheduled", labels,
                                    buckets=TTFT_BUCKETS, registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency",
                             labels, buckets=ITL_BUCKETS, registry=self.registry)
        self.success = Counter("vllm:request_success", "Finished requests",
                               labels + ["finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens",
                                         labels, registry=self.registry)

    def observe_finished(self, reason: str, prompt_tokens: int, output_tokens: int,
                         tenant: str = "") -> None:
        self.success.labels(self.model, tenant, reason).inc()
        self.prompt_tokens.labels(self.model, tenant).inc(prompt_tokens)
        self.generation_tokens.labels(self.model, tenant).inc(output_tokens)
