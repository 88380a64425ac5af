"""Several gateways on one local cluster (real processes, a real redis-server): each one
serves on its own consecutive ports and sees every worker; `/debug/workers` is an admin
route (401 without the key, 403 with a wrong one) and the key never shows on a command
line; a start that lost a port it chose starts again on fresh ones; scheduling
strategies stored through one gateway reach the other; a frozen (SIGSTOPped) worker
leaves routing on both gateways within the load heartbeat window, its streams resume on
the other worker token-identical, and it comes back after SIGCONT."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cluster import launcher
from cluster.gateways import debug_workers, is_gateway, routable_addresses
from cluster.launcher import Child, ClusterSpec, LocalCluster
from cluster.launcher import free_port as real_free_port
from tests.factories import tiny_model_dir
from tests.integration.serving_util import call_http, wait_for

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make sysdeps)")

STALE_S = 3.0  # the gateways' --load-stale (the default)
BODY = {"prompt": "several gateways share one redis " * 3, "max_tokens": 40,
        "temperature": 0, "ignore_eos": True, "logprobs": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("gateways")
    # Paced responses (40 ms each): a stream is still running when its worker freezes.
    spec = ClusterSpec(model_dir=tiny_model_dir("llama"), num_colocated=2, num_gateways=2,
                       worker_args=("--num-blocks", "64",
                                    "--faults", "seed=1,rpc.delay=1,delay=0.04"),
                       gateway_args=("--failover-wait", "5"), ready_timeout_s=150,
                       log_dir=str(tmp / "logs"))
    # The start loses its first chosen port (redis-server's) to another process, as on a
    # busy machine between the choice and the child's bind: it starts again on fresh ones.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        chosen: list[int] = []

        def free_port(host: str = "127.0.0.1") -> int:
            chosen.append(taken if not chosen else real_free_port(host))
            return chosen[-1]
        c = LocalCluster(spec)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(launcher, "free_port", free_port)
            c.start()
    c.lost_port = taken  # type: ignore[attr-defined]
    try:
        yield c
    finally:
        c.stop()


def gateways(cluster: LocalCluster) -> list[Child]:
    return [c for c in cluster.children if is_gateway(c.name)]


def complete(port: int) -> list[str]:
    got, body, _ = call_http(port, "POST", "/v1/completions", BODY, timeout=60)
    assert got == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    return list(choice["logprobs"]["tokens"])


def test_a_start_that_lost_a_port_started_again_on_fresh_ports(cluster: LocalCluster) -> None:
    assert cluster.redis_url and not cluster.redis_url.endswith(f":{cluster.lost_port}")  # type: ignore[attr-defined]
    assert all(c.proc.poll() is None for c in cluster.children)


def test_each_gateway_serves_on_consecutive_ports(cluster: LocalCluster) -> None:
    assert [g.name for g in gateways(cluster)] == ["gateway", "gateway-1"]
    assert cluster.http_ports[1] == cluster.http_ports[0] + 1
    assert cluster.grpc_ports[1] == cluster.grpc_ports[0] + 1
    workers = {c.grpc_address for c in cluster.children if c.name.startswith("colocated")}
    outputs = []
    for port in cluster.http_ports:
        assert call_http(port, "GET", "/health")[0] == 200
        assert routable_addresses("127.0.0.1", port, cluster.admin_key) == workers
        outputs.append(complete(port))
    assert outputs[0] == outputs[1] and len(outputs[0]) == 40


def test_debug_workers_needs_the_admin_key(cluster: LocalCluster) -> None:
    for port in cluster.http_ports:
        got, body, _ = call_http(port, "GET", "/debug/workers")
        assert got == 401, body
        assert body["error"]["code"] == 401 or "admin" in str(body)
        got, body, _ = call_http(port, "GET", "/debug/workers",
                                 headers={"Authorization": "Bearer not-the-admin-key"})
        assert got == 403, body
        assert len(debug_workers("127.0.0.1", port, cluster.admin_key)) == 2
    for gw in gateways(cluster):  # handed over in the environment, never on argv
        with open(f"/proc/{gw.proc.pid}/cmdline", "rb") as f:
            assert cluster.admin_key.encode() not in f.read()
        assert gw.env["SPLITSERVE_ADMIN_KEY"] == cluster.admin_key


def test_strategies_stored_through_one_gateway_reach_the_other(cluster: LocalCluster) -> None:
    auth = {"Authorization": f"Bearer {cluster.admin_key}"}
    first, second = cluster.http_ports
    got, stored, _ = call_http(first, "POST", "/api/v1/scheduling/strategies", {
        "scheduling": [{"priority": True, "selectors": [{"key": "tenant", "value": "gold"}]}]},
        headers=auth)
    assert got == 200, stored

    def seen() -> Any:
        code, doc, _ = call_http(second, "GET", "/api/v1/scheduling/strategies", headers=auth)
        return code == 200 and doc["version"] == stored["version"]
    wait_for(seen, 5, "the other gateway to apply the stored strategies")


def test_frozen_worker_leaves_routing_and_its_streams_resume(cluster: LocalCluster) -> None:
    expected = complete(cluster.http_ports[0])
    results: list[Any] = []

    def send(port: int) -> None:
        try:
            results.append(complete(port))
        except AssertionError as e:
            results.append(e)
    senders = [threading.Thread(target=send, args=(cluster.http_ports[i % 2],))
               for i in range(4)]
    for t in senders:
        t.start()

    def busy() -> list[dict[str, Any]]:
        return [w for p in cluster.http_ports
                for w in debug_workers("127.0.0.1", p, cluster.admin_key) if w["inflight"]]
    wait_for(lambda: bool(busy()), 10, "a worker serving the streams")
    address = busy()[0]["address"]
    victim = next(c for c in cluster.children if c.grpc_address == address)
    os.kill(victim.proc.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        wait_for(lambda: all(address not in (routable_addresses("127.0.0.1", p,
                                                                cluster.admin_key) or {address})
                             for p in cluster.http_ports), STALE_S + 2,
                 "the frozen worker to leave routing on both gateways")
        left_s = time.monotonic() - frozen_at
        for t in senders:
            t.join(60)
        assert results == [expected] * 4, results  # resumed elsewhere, token-identical
        assert complete(cluster.http_ports[1]) == expected  # routed around it
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    wait_for(lambda: all(address in (routable_addresses("127.0.0.1", p, cluster.admin_key)
                                     or set()) for p in cluster.http_ports), 10,
             "the thawed worker back in routing on both gateways")
    print(f"frozen worker out of routing after {left_s:.1f} s")
    assert victim.proc.poll() is None and cluster.restarts[victim.name] == 0
