"""Cache-locality routing with real processes: redis-server, two colocated workers that
publish their blocks to the Redis index, and the gateway routing on it. Repeated
prompts go to the worker holding their prefix; killing Redis fails no request; when it
comes back (empty) the workers rebuild the index and locality routing resumes."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis

from cluster.launcher import ClusterSpec, LocalCluster
from engine.block_hash import hash_blocks, make_extra_key
from kvtransfer.index import RedisBlockIndex
from tests.factories import tiny_model_dir
from tests.integration.serving_util import call_http, metric, wait_for
from tests.redis_server import RedisServer

BS = 16
WORKER_ARGS = ("--num-blocks", "128", "--max-num-seqs", "8", "--max-model-len", "512",
               "--max-num-batched-tokens", "256", "--log-level", "INFO")
ADMIN = "locality-admin-key"
PROFILE = """routing:
  scorers:
    - {name: prefix_locality, weight: 3.0}
    - {name: queue, weight: 1.0}
  picker: max_score
"""


@pytest.fixture(scope="module")
def spare_redis():
    """Redis servers a test starts in place of the cluster's; stopped after the cluster
    (workers and gateway talk to Redis while they shut down)."""
    servers: list[RedisServer] = []
    yield servers
    for s in servers:
        s.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, spare_redis):
    logs = tmp_path_factory.mktemp("locality-logs")
    profile = logs / "routing.yaml"
    profile.write_text(PROFILE)
    spec = ClusterSpec(model_dir=tiny_model_dir("llama"), num_colocated=2,
                       worker_args=WORKER_ARGS, ready_timeout_s=150, log_dir=str(logs),
                       gateway_args=("--routing", str(profile), "--admin-key", ADMIN))
    with LocalCluster(spec) as c:
        yield c


def model_name(cluster) -> str:
    return os.path.basename(os.path.normpath(cluster.spec.model_dir))


def prompt(seed: int, n: int = 150) -> list[int]:
    return [(i * 7 + seed * 131) % 480 + 10 for i in range(n)]


def complete(cluster, ids: list[int]) -> int:
    """Sends one greedy completion; returns the cached prompt tokens the worker used."""
    status, body, _ = call_http(cluster.http_port, "POST", "/v1/completions",
                                {"prompt": ids, "max_tokens": 2, "temperature": 0})
    assert status == 200, body
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def holders(cluster, ids: list[int]) -> dict[str, int]:
    """Worker id -> leading blocks of `ids` the index says it holds."""
    hashes = hash_blocks(ids, BS, make_extra_key(model_name(cluster)))

    async def look() -> dict[str, int]:
        idx = RedisBlockIndex(cluster.redis_url, model_name(cluster))
        try:
            res = await idx.lookup(hashes)
            return {} if res is None else {n: len(t) for n, t in res.nodes.items()}
        finally:
            await idx.close()

    return asyncio.run(look())


def full_hit(ids: list[int]) -> int:
    return (len(ids) - 1) // BS * BS


def test_repeated_prompts_go_to_the_worker_holding_their_prefix(cluster) -> None:
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    wait_for(lambda: len(r.hgetall(f"kvidx:{model_name(cluster)}:@epochs")) == 2, 20,
             "both workers registered in the block index")
    prompts = [prompt(s) for s in range(4)]
    for ids in prompts:
        assert complete(cluster, ids) == 0
    for ids in prompts:
        wait_for(lambda ids=ids: max(holders(cluster, ids).values(), default=0) == len(ids)
                 // BS, 10, "the prefix in the index")
        assert len(holders(cluster, ids)) == 1  # exactly one worker holds it
    # Random routing would hit the holder 8 times in a row with probability 1/256.
    for _ in range(2):
        for ids in prompts:
            assert complete(cluster, ids) == full_hit(ids)
    port = cluster.http_port
    assert metric(port, "splitserve:routing_decisions_by_reason_total",
                  reason="prefix_hit") >= 8
    assert metric(port, "splitserve:index_lookups_total", result="hit") >= 8
    for w in ("colocated-0", "colocated-1"):  # the index was right: full accuracy
        if metric(port, "splitserve:predicted_cached_tokens_total", worker=w) > 0:
            assert metric(port, "splitserve:index_accuracy", worker=w) > 0.9


def test_admin_api_swaps_the_live_profile(cluster) -> None:
    port = cluster.http_port
    auth = {"Authorization": f"Bearer {ADMIN}"}
    assert call_http(port, "GET", "/admin/v1/routing")[0] == 401
    assert call_http(port, "GET", "/admin/v1/routing",
                     headers={"Authorization": "Bearer nope"})[0] == 403
    status, live, _ = call_http(port, "GET", "/admin/v1/routing", headers=auth)
    assert status == 200 and live["picker"] == "max_score"
    assert call_http(port, "POST", "/admin/v1/routing", b"picker: [", headers=auth)[0] == 400
    body = PROFILE.replace("max_score", "power_of_two").encode()
    status, new, _ = call_http(port, "POST", "/admin/v1/routing", body, headers=auth)
    assert status == 200 and new["picker"] == "power_of_two"
    assert call_http(port, "GET", "/admin/v1/routing", headers=auth)[1] == new
    ids = prompt(0)  # still routed on locality under the new profile (2 candidates)
    assert complete(cluster, ids) == full_hit(ids)


def test_redis_outage_fails_no_request_and_the_index_is_rebuilt(cluster, spare_redis) -> None:
    port = cluster.http_port
    before = holders(cluster, prompt(1))
    assert before
    redis_child = next(c for c in cluster.children if c.name == "redis")
    cluster.stop_child(redis_child, sig=9)
    unavailable = metric(port, "splitserve:routing_decisions_by_reason_total",
                         reason="index_unavailable")
    for s in range(10, 14):  # Redis is down: load-only routing, every request succeeds
        complete(cluster, prompt(s, 40))
    assert metric(port, "splitserve:routing_decisions_by_reason_total",
                  reason="index_unavailable") >= unavailable + 4
    server = RedisServer(port=int(cluster.redis_url.rsplit(":", 1)[1])).start()  # empty
    spare_redis.append(server)
    # The workers notice the empty Redis and republish what they hold.
    wait_for(lambda: holders(cluster, prompt(1)) == before, 20, "the index rebuilt")
    workers = [c for c in cluster.children if c.name.startswith("colocated")]
    wait_for(lambda: all(metric(int(w.extra["metrics_port"]),
                                "splitserve:index_resyncs_total") >= 2 for w in workers),
             10, "both workers republished (at start and after the restart)")
    ids = prompt(20)
    complete(cluster, ids)
    wait_for(lambda: bool(holders(cluster, ids)), 10, "the new prefix in the index")
    hits = metric(port, "splitserve:routing_decisions_by_reason_total",
                  reason="prefix_hit")
    # the gateway's breaker lets a probe through after its cooldown
    wait_for(lambda: complete(cluster, ids) == full_hit(ids) and metric(
        port, "splitserve:routing_decisions_by_reason_total", reason="prefix_hit") > hits,
        15, "locality routing back", every=0.5)
    assert complete(cluster, ids) == full_hit(ids)
