"""engine/strategies.py: validation, matching, and the Redis format (real redis-server)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from engine import strategies as st
from tests.redis_server import RedisServer

GOLD = {"priority": True, "execution_time": 20_000_000,
        "selectors": [{"key": "tenant", "value": "gold"}]}


def test_round_trip_keeps_only_what_was_set() -> None:
    doc = {"scheduling": [GOLD, {"weight": 2, "max_running": 3,
                                 "selectors": [{"key": "tier", "value": "paid"}]},
                          {"priority": False, "request_id": "cmpl-1"}]}
    s = st.parse(doc)
    assert s.version == 0
    assert s.to_dict() == {"version": 0, **doc}
    assert st.parse(s.to_dict()) == s


@pytest.mark.parametrize("doc, reason", [
    ([], "JSON object"),
    ({"strategies": []}, "unknown field 'strategies'"),
    ({"scheduling": {}}, "must be a list"),
    ({"scheduling": [{"weight": 1, "selectors": [], "cpu": 3}]}, "unknown field 'cpu'"),
    ({"scheduling": [{"selectors": [{"key": "a", "value": "b"}]}]}, "sets none"),
    ({"scheduling": [{"execution_time": -5, "request_id": "r"}]}, "execution_time"),
    ({"scheduling": [{"execution_time": 1.5, "request_id": "r"}]}, "execution_time"),
    ({"scheduling": [{"weight": 0, "request_id": "r"}]}, "weight"),
    ({"scheduling": [{"weight": True, "request_id": "r"}]}, "weight"),
    ({"scheduling": [{"max_running": 0, "request_id": "r"}]}, "max_running"),
    ({"scheduling": [{"priority": 1, "request_id": "r"}]}, "priority"),
    ({"scheduling": [{"priority": True}]}, "exactly one target"),
    ({"scheduling": [{"priority": True, "request_id": "r",
                      "selectors": [{"key": "a", "value": "b"}]}]}, "exactly one target"),
    ({"scheduling": [{"priority": True, "request_id": ""}]}, "request_id"),
    ({"scheduling": [{"priority": True, "selectors": []}]}, "non-empty list"),
    ({"scheduling": [{"priority": True, "selectors": [{"key": "a"}]}]}, "selectors[0]"),
    ({"scheduling": [{"priority": True, "selectors": [{"key": "", "value": "b"}]}]}, "'key'"),
    ({"scheduling": [{"priority": True, "selectors": [{"key": "a", "value": 3}]}]},
     "'value'"),
    ({"scheduling": [{"priority": True, "selectors": [
        {"key": "a", "value": "b"}, {"key": "a", "value": "c"}]}]}, "selected twice"),
    ({"scheduling": [], "version": -1}, "version"),
])
def test_invalid_strategies_say_why(doc: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        st.parse(doc)


def test_matching_takes_each_field_from_the_first_match() -> None:
    s = st.parse({"scheduling": [
        {"weight": 2, "selectors": [{"key": "tenant", "value": "a"}]},
        {"weight": 5, "max_running": 4, "selectors": [{"key": "tier", "value": "paid"}]},
        {"priority": True, "execution_time": 7, "selectors": [
            {"key": "tenant", "value": "a"}, {"key": "tier", "value": "paid"}]},
        {"weight": 9, "request_id": "vip"},
    ]})
    assert s.for_request("a", {"tier": "paid"}, "x") == st.Policy(
        priority=True, execution_time_ns=7, weight=2.0, max_running=4)
    assert s.for_request("a", {}, "x") == st.Policy(weight=2.0)
    assert s.for_request("b", {"tier": "paid"}) == st.Policy(weight=5.0, max_running=4)
    assert s.for_request("b", {"tier": "free"}) is st.DEFAULT_POLICY
    # the request-id strategy wins its field; the rest still come from the selectors
    assert s.for_request("a", {"tier": "paid"}, "vip") == st.Policy(
        priority=True, execution_time_ns=7, weight=9.0, max_running=4)
    # the tenant is the label "tenant", whatever the labels say
    assert s.for_request("b", {"tenant": "a"}) is st.DEFAULT_POLICY


def test_module_imports_nothing_heavy() -> None:
    code = ("import sys, engine.strategies; "
            "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = RedisServer().start()
    yield server.url
    server.kill()


def test_redis_store_bumps_the_version_atomically(redis_url: str) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url, socket_timeout=2.0)
        try:
            assert await st.load_strategies(client, "m") == st.EMPTY
            one = st.parse({"scheduling": [GOLD]})
            stored = await st.store_strategies(client, "m", one)
            assert stored.version == 1 and stored.strategies == one.strategies
            raw = await client.get("splitserve:m:strategies")
            assert raw is not None
            assert json.loads(raw) == {"version": 1, "scheduling": [GOLD]}
            # twenty concurrent stores: twenty distinct versions, the last one stored
            got = await asyncio.gather(*(st.store_strategies(client, "m", st.EMPTY)
                                         for _ in range(20)))
            assert sorted(s.version for s in got) == list(range(2, 22))
            assert (await st.load_strategies(client, "m")) == st.StrategySet(21, ())
            assert (await st.load_strategies(client, "other")).version == 0
            await client.set("splitserve:m:strategies", "{not json")
            with pytest.raises(ValueError, match="not JSON"):
                await st.load_strategies(client, "m")
        finally:
            await client.aclose()
    asyncio.run(main())
