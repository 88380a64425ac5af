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
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # vLLM's
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


class StagingCollector(Collector):
    """`splitserve:kv_staging_blocks_total`, read from the one count the model runner
    keeps (`ModelRunner.staged_blocks`: every gather into and scatter out of rank 0's
    full-head staging copy, the hand-off's and the offload tiers' alike); `count` gives
    None before the engine exists (0 then)."""

    def __init__(self, count: Callable[[], int | None]) -> None:
        self._count = count

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "splitserve:kv_staging_blocks", "KV blocks copied through rank 0's full-head "
            "staging copy (tensor parallelism where rank 0 cannot address its ranks' "
            "caches: CUDA), by the hand-off and the offload tiers; 0 where each rank's "
            "heads move directly", value=float(self._count() or 0))


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


class _CacheConfigInfo(Collector):
    """vLLM's `vllm:cache_config_info`: the KV cache's configuration as labels, value 1."""

    def __init__(self, info: Callable[[], dict[str, str] | None]) -> None:
        self._info = info

    def collect(self) -> Iterator[Metric]:
        info = self._info()
        if info is None:  # model not loaded yet
            return
        g = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                              "CacheConfig", labels=sorted(info))
        g.add_metric([info[k] for k in sorted(info)], 1.0)
        yield g


class WorkerMetrics:
    def __init__(self, model: str, stats: Callable[[], SchedulerStats | None],
                 cache_info: Callable[[], dict[str, str] | None] | None = None) -> None:
        """`cache_info`: the KV cache's settings, exported as vllm:cache_config_info."""
        self.registry = CollectorRegistry()
        self.model = model
        self.registry.register(_StatsCollector(model, stats))
        if cache_info is not None:
            self.registry.register(_CacheConfigInfo(cache_info))
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
        # vLLM's request phases: scheduled -> first token (prefill; a remote prefill's
        # time counts from arrival here), first -> last token (decode), and both.
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.",
                                      labels, buckets=REQUEST_BUCKETS, registry=self.registry)
        self.decode_time = Histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.",
                                     labels, buckets=REQUEST_BUCKETS, registry=self.registry)
        self.inference_time = Histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", labels,
            buckets=REQUEST_BUCKETS, registry=self.registry)
        self.tpot = Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", labels,
            buckets=ITL_BUCKETS, registry=self.registry)
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            ["model_name"], buckets=ITERATION_BUCKETS, registry=self.registry)

    def observe_step(self, num_tokens: int) -> None:
        """One engine step's computed tokens (called on the engine thread)."""
        self.iteration_tokens.labels(self.model).observe(num_tokens)

    def observe_phases(self, scheduled: float, first_token: float, last_token: float,
                       output_tokens: int, tenant: str = "") -> None:
        """A finished request's prefill, decode and inference times (monotonic s), and
        its time per output token after the first (with two tokens or more)."""
        self.prefill_time.labels(self.model, tenant).observe(max(first_token - scheduled, 0.0))
        self.decode_time.labels(self.model, tenant).observe(max(last_token - first_token, 0.0))
        self.inference_time.labels(self.model, tenant).observe(
            max(last_token - scheduled, 0.0))
        if output_tokens > 1:
            self.tpot.labels(self.model, tenant).observe(
                max(last_token - first_token, 0.0) / (output_tokens - 1))

    def observe_finished(self, reason: str, prompt_tokens: int, output_tokens: int,
                         tenant: str = "") -> None:
        self.success.labels(self.model, tenant, reason).inc()
        self.prompt_tokens.labels(self.model, tenant).inc(prompt_tokens)
        self.generation_tokens.labels(self.model, tenant).inc(output_tokens)
