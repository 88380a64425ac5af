"""Admission control, request identity and the scheduling-strategies API with real
processes: redis-server, one colocated worker that runs one request at a time, and the
gateway with a tiny admission queue (so overload is cheap), started as `splitserve up`
does. The test that kills the gateway runs last."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time

import grpc
import pytest

from cluster.launcher import ClusterSpec, LocalCluster
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from tests.factories import tiny_model_dir
from tests.integration.serving_util import call_http, metric, wait_for

ADMIN = {"Authorization": "Bearer admin-key-123"}
HEAVY = {"Authorization": "Bearer heavy-key-123"}
GOLD = {"Authorization": "Bearer gold-key-1234"}
PLAIN = {"Authorization": "Bearer plain-key-123"}
TENANTS = """keys:
  heavy-key-123: {tenant: heavy}
  gold-key-1234: {tenant: gold, labels: {tier: paid}}
"""
STRATEGIES = "/api/v1/scheduling/strategies"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("admission-logs")
    tenants = logs / "tenants.yaml"
    tenants.write_text(TENANTS)
    spec = ClusterSpec(
        model_dir=tiny_model_dir("llama"), num_colocated=1, ready_timeout_s=150,
        worker_args=("--num-blocks", "64", "--max-num-seqs", "1", "--max-model-len", "256",
                     "--max-num-batched-tokens", "256", "--log-level", "WARNING"),
        gateway_args=("--tenants", str(tenants), "--api-key", "plain-key-123",
                      "--trust-client-identity", "--admin-key", "admin-key-123",
                      "--max-waiting-per-worker", "1", "--admission-queue", "2",
                      "--strategies-poll", "0.2"),
        log_dir=str(logs))
    with LocalCluster(spec) as c:
        yield c


def _complete(port: int, headers: dict[str, str], max_tokens: int = 8,
              **body: object) -> tuple[int, object, dict[str, str]]:
    return call_http(port, "POST", "/v1/completions", {
        "prompt": "The quick brown fox", "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, **body}, headers)


def _grpc_overloaded(port: int, n: int = 4) -> list[grpc.aio.AioRpcError]:
    """`n` concurrent short gRPC Generates as the heavy tenant; the errors they got (a
    queue slot may free as they arrive: not all of them need be refused)."""
    async def main() -> list[grpc.aio.AioRpcError]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.GenerateStub(ch)

            async def call() -> grpc.aio.AioRpcError | None:
                req = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(
                    max_tokens=4, temperature=0.0, ignore_eos=True))
                try:
                    async for _ in stub.Generate(req, timeout=60, metadata=(
                            ("authorization", HEAVY["Authorization"]),)):
                        pass
                except grpc.aio.AioRpcError as e:
                    return e
                return None
            return [e for e in await asyncio.gather(*(call() for _ in range(n))) if e]
    return asyncio.run(main())


def test_overload_gets_429_with_retry_after_and_health_stays_fast(cluster) -> None:
    port = cluster.http_port
    assert _complete(port, HEAVY)[0] == 200  # warm
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        flood = [pool.submit(_complete, port, HEAVY, 200) for _ in range(10)]
        wait_for(lambda: metric(port, "splitserve:gateway_rejected_total",
                                reason="admission_queue_full") > 0, 20, "a 429")
        grpc_err = pool.submit(_grpc_overloaded, cluster.grpc_port)
        health = []
        while not all(f.done() for f in flood):
            t0 = time.monotonic()
            status = call_http(port, "GET", "/health", timeout=5)[0]
            health.append((status, time.monotonic() - t0))
            time.sleep(0.05)
        results = [f.result() for f in flood]
        errors = grpc_err.result()
    statuses = sorted(r[0] for r in results)
    # One running, one waiting on the worker, two in the gateway's queue; the rest 429.
    assert statuses.count(200) >= 3 and statuses.count(429) >= 3, statuses
    assert set(statuses) == {200, 429}, statuses
    for status, body, headers in results:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            assert body["error"]["type"] == "RateLimitError"
    assert health and all(s == 200 for s, _ in health)
    assert max(dt for _, dt in health) < 1.0, max(dt for _, dt in health)
    assert errors and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors)
    trailers = dict(errors[0].trailing_metadata() or ())
    assert int(trailers["retry-after"]) >= 1 and int(trailers["grpc-retry-pushback-ms"]) >= 1000
    assert metric(port, "splitserve:gateway_rejected_total", tenant="heavy") \
        == statuses.count(429) + len(errors)


def test_tenant_from_key_headers_and_metadata_reaches_the_worker(cluster) -> None:
    port = cluster.http_port
    worker_port = int(next(c for c in cluster.children if c.name.startswith("colocated"))
                       .extra["metrics_port"])
    cases = [(GOLD, {}, {}, "gold"),  # the key's tenant
             ({**GOLD, "X-Tenant": "mallory"}, {}, {}, "gold"),  # the key wins over claims
             ({**PLAIN, "X-Tenant": "silver", "X-Labels": "team=a"}, {}, {}, "silver"),
             (PLAIN, {"metadata": {"tenant": "bronze", "team": "b"}}, {}, "bronze"),
             (PLAIN, {}, {}, "default")]
    for headers, body, _, tenant in cases:
        before = metric(worker_port, "vllm:generation_tokens_total", tenant=tenant)
        status, resp, _ = _complete(port, headers, 3, **body)
        assert status == 200, resp
        assert metric(port, "splitserve:gateway_generation_tokens_total", tenant=tenant) >= 3
        assert metric(worker_port, "vllm:generation_tokens_total", tenant=tenant) == before + 3
    assert metric(port, "splitserve:gateway_time_to_first_token_seconds_count",
                  tenant="gold") >= 2
    bad = [({**PLAIN, "X-Labels": "novalue"}, {}), (PLAIN, {"metadata": {"n": 1}}),
           ({**PLAIN, "X-Tenant": "bad tenant!"}, {})]
    for headers, body in bad:
        status, resp, _ = _complete(port, headers, 3, **body)
        assert status == 400 and resp["error"]["type"] == "BadRequestError", resp
    assert _complete(port, {"Authorization": "Bearer nope"})[0] == 401


def test_invalid_strategies_get_400_with_the_reason(cluster) -> None:
    port = cluster.http_port
    sel = [{"key": "tenant", "value": "gold"}]
    cases = [({"scheduling": [{"priority": True, "selectors": sel, "nice": 1}]}, "'nice'"),
             ({"scheduling": [{"weight": 2, "selectors": [{"key": "tenant"}]}]}, "selector"),
             ({"scheduling": [{"execution_time": -5, "selectors": sel}]}, "execution_time"),
             ({"strategies": []}, "unknown field")]
    for body, reason in cases:
        status, resp, _ = call_http(port, "POST", STRATEGIES, body, ADMIN)
        assert status == 400 and reason in resp["error"]["message"], resp
    assert call_http(port, "POST", STRATEGIES, {"scheduling": []}, {})[0] == 401
    assert call_http(port, "GET", STRATEGIES, None, PLAIN)[0] == 403


def test_strategies_are_versioned_and_survive_a_gateway_restart(cluster) -> None:
    port = cluster.http_port
    v0 = call_http(port, "GET", STRATEGIES, None, ADMIN)[1]["version"]
    doc = {"scheduling": [
        {"priority": True, "execution_time": 20000000,
         "selectors": [{"key": "tenant", "value": "gold"}]},
        {"weight": 2, "max_running": 4, "selectors": [{"key": "tier", "value": "paid"}]}]}
    status, stored, _ = call_http(port, "POST", STRATEGIES, doc, ADMIN)
    assert status == 200 and stored == {"version": v0 + 1, **doc}
    assert metric(port, "splitserve:scheduling_strategies_version") == v0 + 1
    gateway = next(c for c in cluster.children if c.name == "gateway")
    os.kill(gateway.proc.pid, signal.SIGKILL)

    def back() -> bool:
        cluster.supervise()  # what `splitserve up` does: restart it
        try:
            return call_http(port, "GET", STRATEGIES, None, ADMIN, timeout=2)[0] == 200
        except OSError:
            return False
    wait_for(back, 60, "the gateway to come back", every=0.3)
    assert cluster.restarts.get("gateway") == 1
    assert call_http(port, "GET", STRATEGIES, None, ADMIN)[1] == stored
    assert metric(port, "splitserve:scheduling_strategies_version") == v0 + 1
    assert _complete(port, GOLD)[0] == 200  # and it serves under them
