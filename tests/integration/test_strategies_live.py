"""Scheduling strategies reach a running worker process through a real redis-server:
a stored version is applied within one second without a restart, a restarted worker
starts with the current one, and a tenant's requests show in the per-tenant metrics."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from cluster.health import is_ready
from cluster.launcher import ROOT, free_port
from engine import strategies as st
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from protos.auth import RpcSecurity
from tests.factories import child_env, tiny_model_dir
from tests.integration.serving_util import metric, wait_for
from tests.redis_server import RedisServer

MODEL = "tiny"
VERSION = "splitserve:scheduling_strategies_version"


class Worker:
    def __init__(self, redis_url: str) -> None:
        self.port, self.metrics = free_port(), free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "worker", "--model", tiny_model_dir("llama"),
             "--served-model-name", MODEL, "--role", "colocated", "--worker-id", "w0",
             "--port", str(self.port), "--metrics-port", str(self.metrics), "--redis",
             redis_url, "--num-blocks", "64", "--scheduling-policy", "vtc",
             "--drain-timeout", "2"],
            cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(self.ready, 90, "the worker to load its model")

    def ready(self) -> bool:
        """The worker's own readiness (grpc.health.v1, as the launcher waits for it): it
        turns SERVING after the first read of the strategies. The gRPC port opens and
        the gauge appears before that, with version 0."""
        assert self.proc.poll() is None, "worker exited"
        return is_ready(f"127.0.0.1:{self.port}")

    def version(self) -> float:
        return metric(self.metrics, VERSION)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def store(url: str, doc: dict[str, object]) -> int:
    async def main() -> int:
        client = aioredis.Redis.from_url(url, socket_timeout=2.0)
        try:
            return (await st.store_strategies(client, MODEL, st.parse(doc))).version
        finally:
            await client.aclose()
    return asyncio.run(main())


def generate(port: int, tenant: str) -> list[int]:
    async def main() -> list[int]:
        token = os.environ.get("SPLITSERVE_CLUSTER_TOKEN", "")  # tests/conftest.py
        async with RpcSecurity(token).channel(f"127.0.0.1:{port}") as ch:
            req = pb.WorkerGenerateRequest(
                request_id=f"{tenant}-1", prompt_token_ids=list(range(5, 30)),
                sampling=pb.SamplingParams(max_tokens=4, temperature=0.0), tenant=tenant,
                labels={"tier": "paid"})
            out: list[int] = []
            async for r in pb_grpc.WorkerStub(ch).Generate(req, timeout=30):
                out += r.token_ids
            return out
    return asyncio.run(main())


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = RedisServer().start()
    yield server.url
    server.kill()


def test_strategies_apply_live_and_survive_a_worker_restart(redis_url: str) -> None:
    w = Worker(redis_url)
    try:
        assert w.version() == 0
        t0 = time.monotonic()
        v = store(redis_url, {"scheduling": [
            {"priority": True, "selectors": [{"key": "tenant", "value": "gold"}]}]})
        wait_for(lambda: w.version() == v, 1.0, "the worker to apply the new version",
                 every=0.02)
        applied_s = time.monotonic() - t0
        assert applied_s < 1.0
        print(f"strategies version {v} applied {applied_s * 1000:.0f} ms after the store")
        assert len(generate(w.port, "gold")) == 4
        assert metric(w.metrics, "vllm:time_to_first_token_seconds_count", tenant="gold") == 1
        assert metric(w.metrics, "vllm:request_queue_time_seconds_count", tenant="gold") == 1
        assert metric(w.metrics, "vllm:generation_tokens_total", tenant="gold") == 4
        w.stop()
        v2 = store(redis_url, {"scheduling": [
            {"weight": 3, "selectors": [{"key": "tier", "value": "paid"}]}]})
        w = Worker(redis_url)  # a restarted worker reads the current version before ready
        assert w.version() == v2
    finally:
        w.stop()
