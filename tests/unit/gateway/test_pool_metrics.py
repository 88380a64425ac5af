"""The gateway exports its pool's load under vLLM's names, as the Gateway API Inference
Extension's endpoint picker reads them from each pool member (a gateway pod)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import PoolLoad
from gateway.routing.base import Candidate


def scrape(candidates: list[Candidate], queued: int) -> dict[str, float]:
    reg = CollectorRegistry()
    reg.register(PoolLoad("tiny", lambda: candidates, lambda: queued))
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            assert s.labels == {"model_name": "tiny"}
            out[s.name] = s.value
    return out


def test_pool_load_sums_the_workers_and_the_admission_queue() -> None:
    workers = [
        Candidate("p0", "a:1", "prefill", num_waiting=3, num_running=1, num_blocks=100,
                  num_free_blocks=10),  # a prefill pool holds no request's KV for long
        Candidate("d0", "a:2", "decode", num_waiting=2, num_running=5, num_blocks=100,
                  num_free_blocks=40),
        Candidate("c0", "a:3", "colocated", num_waiting=0, num_running=2, num_blocks=300,
                  num_free_blocks=260),
    ]
    got = scrape(workers, queued=4)
    assert got["vllm:num_requests_waiting"] == 4 + 3 + 2
    assert got["vllm:num_requests_running"] == 1 + 5 + 2
    assert got["vllm:kv_cache_usage_perc"] == (60 + 40) / 400


def test_no_workers_reads_as_an_idle_pool() -> None:
    assert scrape([], queued=0) == {"vllm:num_requests_waiting": 0.0,
                                    "vllm:num_requests_running": 0.0,
                                    "vllm:kv_cache_usage_perc": 0.0}
