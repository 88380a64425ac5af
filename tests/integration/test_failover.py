"""Authenticated worker RPCs and decode fail-over, with real processes: redis-server,
two decode workers and the gateway. The workers' Generate responses are paced by the
fault layer (`rpc.delay`), so a test can SIGKILL the worker serving a stream while it
streams: the gateway resumes it on the other worker with the tokens already sent."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.launcher import Child, ClusterSpec, LocalCluster
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from protos.auth import AUTH_KEY, sign
from tests.factories import tiny_model_dir
from tests.integration.serving_util import admin, call_http, load_report, metric, wait_for

NUM_BLOCKS = 64
MAX_TOKENS = 40
GENERATE = "/splitserve.v1.Worker/Generate"
PROMPT = [(13 * j) % 400 + 7 for j in range(37)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("failover")
    spec = ClusterSpec(model_dir=tiny_model_dir("llama"), num_decode=2, num_colocated=0,
                       worker_args=("--num-blocks", str(NUM_BLOCKS),
                                    "--faults", "seed=1,rpc.delay=1,delay=0.04"),
                       gateway_args=("--failover-wait", "1.5"),
                       ready_timeout_s=150, log_dir=str(tmp / "logs"))
    with LocalCluster(spec) as c:
        yield c


def decodes(cluster: LocalCluster) -> list[Child]:
    return [c for c in cluster.children if c.name.startswith("decode")]


def test_worker_rpcs_need_the_cluster_credential(cluster: LocalCluster) -> None:
    worker = decodes(cluster)[0]
    assert worker.grpc_address is not None
    port = int(worker.extra["metrics_port"])
    token = os.environ["SPLITSERVE_CLUSTER_TOKEN"]
    req = pb.WorkerGenerateRequest(request_id="auth-1", prompt_token_ids=PROMPT[:9],
                                   sampling=pb.SamplingParams(max_tokens=2, temperature=0))
    with grpc.insecure_channel(worker.grpc_address) as ch:
        stub = pb_grpc.WorkerStub(ch)

        def generate(credential: str | None) -> list[int]:
            md = ((AUTH_KEY, credential),) if credential else ()
            return [t for r in stub.Generate(req, metadata=md, timeout=10) for t in r.token_ids]

        def refused(call: Any) -> str:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            return str(e.value.details())

        work = metric(port, "vllm:prompt_tokens_total")
        assert "missing" in refused(lambda: generate(None))
        assert "missing" in refused(lambda: stub.Info(pb.InfoRequest(), timeout=5))
        assert "missing" in refused(lambda: stub.FetchKV(pb.FetchKVRequest(), timeout=5))
        assert "bad_mac" in refused(lambda: generate(sign("not-the-token", GENERATE)))
        # Signed for another method: the MAC covers the method.
        assert "bad_mac" in refused(lambda: generate(sign(token, "/splitserve.v1.Worker/Info")))
        assert "stale" in refused(lambda: generate(sign(token, GENERATE, time.time() - 120)))
        assert metric(port, "vllm:prompt_tokens_total") == work  # none of them ran
        good = sign(token, GENERATE)
        assert len(generate(good)) == 2
        assert "replay" in refused(lambda: generate(good))
        # Health stays open (probes carry no credential).
        health = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    failures = {r: metric(port, "splitserve:rpc_auth_failures_total", reason=r)
                for r in ("missing", "bad_mac", "stale", "replay")}
    assert failures == {"missing": 3, "bad_mac": 2, "stale": 1, "replay": 1}


class Stream(threading.Thread):
    """One gRPC Generate through the gateway, read in a thread."""

    def __init__(self, address: str, sampling: pb.SamplingParams, timeout: float = 60) -> None:
        super().__init__(daemon=True)
        self.address, self.sampling, self.timeout = address, sampling, timeout
        self.responses: list[pb.GenerateResponse] = []
        self.error: grpc.RpcError | None = None
        self.ended = 0.0

    def run(self) -> None:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=self.sampling)
        try:
            with grpc.insecure_channel(self.address) as ch:
                for r in pb_grpc.GenerateStub(ch).Generate(req, timeout=self.timeout):
                    self.responses.append(r)
        except grpc.RpcError as e:
            self.error = e
        self.ended = time.monotonic()

    @property
    def tokens(self) -> list[int]:
        return [t for r in self.responses for t in r.token_ids]


def serving(cluster: LocalCluster) -> Child:
    """A decode worker streaming to the gateway (its engine may be done already: the
    responses are paced)."""
    _, workers, _ = call_http(cluster.http_port, "GET", "/debug/workers", headers=admin())
    busy = {w["address"] for w in workers if w["inflight"]}
    return next(c for c in decodes(cluster) if c.grpc_address in busy)


def test_decode_killed_mid_stream_resumes_on_the_other(cluster: LocalCluster) -> None:
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_k=50, seed=11,
                            ignore_eos=True)
    refs = LLM(tiny_model_dir("llama"), num_blocks=NUM_BLOCKS).generate([PROMPT] * 2,
                                                                          [greedy, seeded])
    address = f"127.0.0.1:{cluster.grpc_port}"
    streams = [Stream(address, pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                 ignore_eos=True)),
               Stream(address, pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9,
                                                 top_k=50, seed=11, ignore_eos=True))]
    for s in streams:
        s.start()
    wait_for(lambda: all(len(s.tokens) >= 5 for s in streams), 20, "both streams under way")
    victim = serving(cluster)
    os.kill(victim.proc.pid, signal.SIGKILL)  # mid-stream: ~35 tokens still to come
    for s in streams:
        s.join(60)
        assert s.error is None, s.error
    for s, ref in zip(streams, refs, strict=True):
        assert s.tokens == ref.token_ids  # one uninterrupted stream, token-identical
        assert "".join(r.text for r in s.responses) == ref.text  # text deltas join
        last = s.responses[-1]
        assert last.finish_reason == "length" and last.usage.completion_tokens == MAX_TOKENS
    assert metric(cluster.http_port, "splitserve:gateway_failovers_total",
                  outcome="resumed") >= 1
    survivor = next(c for c in decodes(cluster) if c is not victim)
    wait_for(lambda: load_report(survivor.grpc_address or "").num_free_blocks == NUM_BLOCKS,
             10, "every block free on the surviving worker")


def test_no_worker_left_ends_the_stream_cleanly(cluster: LocalCluster) -> None:
    # Runs last: the previous test left one decode worker; killing it mid-stream leaves
    # none to resume on, so the stream ends with a clean error (after --failover-wait).
    s = Stream(f"127.0.0.1:{cluster.grpc_port}",
               pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), timeout=30)
    s.start()
    wait_for(lambda: len(s.tokens) >= 3, 20, "the stream under way")
    t0 = time.monotonic()
    os.kill(serving(cluster).proc.pid, signal.SIGKILL)
    s.join(30)
    assert s.error is not None and s.error.code() == grpc.StatusCode.UNAVAILABLE
    assert "no ready worker" in str(s.error.details())
    assert s.ended - t0 < 5  # the failover wait (1.5 s), not the 30 s deadline
