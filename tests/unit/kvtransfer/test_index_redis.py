"""The block index and the node publisher against a real redis-server on a free port."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest
import redis

from engine.block_hash import BlockHash, hash_blocks, make_extra_key
from engine.block_pool import BlockRemoved, BlockStored
from kvtransfer.index import IndexConfig, IndexUnavailable, RedisBlockIndex
from tests.redis_server import RedisServer, running_redis
from worker.kv_events import KVEventPublisher, PublisherConfig

MODEL = "tiny"
BS = 4


@pytest.fixture
def server():
    with running_redis() as s:
        yield s


def hashes(n: int, salt: str | None = None, first: int = 0) -> list[BlockHash]:
    return hash_blocks(list(range(first, first + n * BS)), BS, make_extra_key(MODEL, salt))


def index(server: RedisServer, **kw) -> RedisBlockIndex:
    return RedisBlockIndex(server.url, MODEL, IndexConfig(**{"timeout_ms": 300, **kw}))


def test_batched_atomic_updates_in_order_and_empty_keys_vanish(server) -> None:
    hs = hashes(6)

    async def main() -> None:
        idx = index(server)
        assert await idx.register("a", 10)
        assert await idx.apply("a", 10, stored=[(h, "device") for h in hs[:4]]
                               + [(hs[1], "host")])
        res = await idx.lookup(hs)
        assert res is not None and res.num_blocks == 4 and res.nodes == {"a": ("device",) * 4}
        # evicted and stored again within one batch: the order holds
        ops = [(False, hs[2], "device"), (True, hs[2], "device"), (True, hs[3], "device"),
               (False, hs[3], "device"), (False, hs[1], "device")]
        assert await idx.apply("a", 10, ordered=ops)
        res = await idx.lookup(hs)
        assert res is not None and res.nodes == {"a": ("device", "host", "device")}
        assert res.num_blocks == 3
        await idx.close()

    asyncio.run(main())
    r = redis.Redis.from_url(server.url, decode_responses=True)
    assert r.exists(f"kvidx:{MODEL}:{hs[3].hex()}") == 0  # last field gone: key deleted
    assert r.hgetall(f"kvidx:{MODEL}:{hs[1].hex()}") == {"a@host": "10"}


def test_apply_with_unregistered_epoch_changes_nothing(server) -> None:
    hs = hashes(2)

    async def main() -> None:
        idx = index(server)
        assert not await idx.apply("a", 10, stored=[(hs[0], "device")])
        assert await idx.register("a", 10)
        assert not await idx.register("a", 9)  # older epochs never win
        assert await idx.registered_epoch("a") == 10 and await idx.registered_epoch("b") is None
        await idx.close()

    asyncio.run(main())
    assert redis.Redis.from_url(server.url).exists(f"kvidx:{MODEL}:{hs[0].hex()}") == 0


def test_ttl_is_refreshed_on_store(server) -> None:
    hs = hashes(2)
    r = redis.Redis.from_url(server.url)
    key = f"kvidx:{MODEL}:{hs[0].hex()}"

    async def main() -> None:
        idx = index(server, ttl_s=1.0)
        await idx.register("a", 1)
        await idx.apply("a", 1, stored=[(hs[0], "device"), (hs[1], "device")])
        await asyncio.sleep(0.6)
        assert 0 < r.pttl(key) <= 400
        await idx.apply("a", 1, stored=[(hs[0], "host")])  # a store refreshes the key
        assert r.pttl(key) > 900
        await asyncio.sleep(0.6)
        assert r.exists(f"kvidx:{MODEL}:{hs[1].hex()}") == 0  # not refreshed: expired
        res = await idx.lookup(hs)
        assert res is not None and res.nodes == {"a": ("device",)}
        await idx.close()

    asyncio.run(main())


def test_new_epoch_hides_old_entries_which_readers_clean(server) -> None:
    hs = hashes(3)
    r = redis.Redis.from_url(server.url, decode_responses=True)

    async def main() -> None:
        idx = index(server)
        await idx.register("a", 1)
        await idx.register("b", 1)
        await idx.apply("a", 1, stored=[(h, "device") for h in hs])
        await idx.apply("b", 1, stored=[(hs[0], "host")])
        await idx.apply("a", 2, stored=[(hs[0], "disk")], check=False)  # resync under way
        res = await idx.lookup(hs)
        assert res is not None and res.nodes["a"] == ("device",) * 3
        await idx.register("a", 2)  # "a" restarted: epoch 2 holds only block 0 on disk
        res = await idx.lookup(hs)
        assert res is not None and res.nodes == {"a": ("disk",), "b": ("host",)}
        await asyncio.sleep(0.1)  # the lazy cleanup task
        assert r.hgetall(f"kvidx:{MODEL}:{hs[0].hex()}") == {"a@disk": "2", "b@host": "1"}
        assert r.exists(f"kvidx:{MODEL}:{hs[1].hex()}") == 0  # its only entry was stale
        assert r.exists(f"kvidx:{MODEL}:{hs[2].hex()}") == 1  # past the chain: left to TTL
        await idx.retire("b", 1)
        res = await idx.lookup(hs)
        assert res is not None and res.nodes == {"a": ("disk",)}
        await idx.close()

    asyncio.run(main())


def test_prefix_lookup_stops_at_first_missing_block(server) -> None:
    hs = hashes(40)
    r = redis.Redis.from_url(server.url)

    async def main() -> None:
        idx = index(server)
        await idx.register("a", 1)
        held = hs[:3] + hs[4:]  # block 3 missing
        await idx.apply("a", 1, stored=[(h, "device") for h in held])
        r.config_resetstat()
        res = await idx.lookup(hs)
        assert res is not None and res.num_blocks == 3 and res.matched("a") == 3
        await idx.close()

    asyncio.run(main())
    calls = int(r.info("commandstats")["cmdstat_hgetall"]["calls"])
    assert calls == 1 + 4  # the epochs, blocks 0..3 (in the server walk): never the other 36


def test_tenants_do_not_see_each_others_blocks(server) -> None:
    a, b = hashes(4, salt="tenant-a"), hashes(4, salt="tenant-b")
    assert not set(a) & set(b)

    async def main() -> None:
        idx = index(server)
        await idx.register("n", 1)
        await idx.apply("n", 1, stored=[(h, "device") for h in a])
        res_a, res_b = await idx.lookup(a), await idx.lookup(b)
        assert res_a is not None and res_a.matched("n") == 4
        assert res_b is not None and res_b.num_blocks == 0 and res_b.nodes == {}
        await idx.close()

    asyncio.run(main())


def test_breaker_opens_when_redis_dies_and_closes_when_it_returns(server) -> None:
    hs = hashes(4)

    async def main() -> None:
        idx = index(server, timeout_ms=200, breaker_failures=2, breaker_cooldown_s=0.3)
        await idx.register("a", 1)
        await idx.apply("a", 1, stored=[(h, "device") for h in hs])
        server.kill()
        assert await idx.lookup(hs) is None and await idx.lookup(hs) is None
        assert idx.breaker.state == "open" and idx.errors == 2
        t0 = time.monotonic()
        for _ in range(100):  # open: "no data" without touching the network
            assert await idx.lookup(hs) is None
        assert time.monotonic() - t0 < 0.05 and idx.errors == 2
        with pytest.raises(IndexUnavailable):
            await idx.apply("a", 1, stored=[(hs[0], "host")])
        server.start()  # same port, empty
        await asyncio.sleep(0.35)
        res = await idx.lookup(hs)
        assert res is not None and res.num_blocks == 0 and idx.breaker.state == "closed"
        await idx.close()

    asyncio.run(main())


class Tier:
    """A tier's state as its owner knows it: the snapshot source of the publisher."""

    def __init__(self) -> None:
        self.held: list[BlockHash] = []

    async def snapshot(self, drop_pending) -> Sequence[BlockHash]:
        drop_pending()
        return list(self.held)


async def wait_until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_publisher_follows_events_and_rebuilds_the_index_after_a_redis_restart(server) -> None:
    hs = hashes(8)
    device, host = Tier(), Tier()

    async def main() -> None:
        cfg = IndexConfig(timeout_ms=200, breaker_failures=2, breaker_cooldown_s=0.2)
        pub = KVEventPublisher(RedisBlockIndex(server.url, MODEL, cfg), "node-1",
                               PublisherConfig(interval_s=0.02, probe_s=0.2))
        pub.add_snapshot_source("device", device.snapshot)
        pub.add_snapshot_source("host", host.snapshot)
        reader = index(server)
        pub.start()

        async def matched(n: int, tiers: tuple[str, ...] | None = None) -> bool:
            res = await reader.lookup(hs)
            return res is not None and res.matched("node-1") == n and (
                tiers is None or res.nodes["node-1"] == tiers)

        device.held = hs[:6]
        pub.on_engine_events([BlockStored(tuple(hs[:6]), None)])
        await wait_until(lambda: matched(6))
        device.held = hs[:4]
        host.held = hs[4:6]
        pub.on_engine_events([BlockRemoved(tuple(hs[4:6]))])
        pub.publish(stored=[(h, "host") for h in hs[4:6]])
        await wait_until(lambda: matched(6, ("device",) * 4 + ("host",) * 2))

        server.kill()  # events while Redis is down stay queued (bounded)
        device.held = hs[:5]
        pub.on_engine_events([BlockStored((hs[4],), hs[3])])
        await asyncio.sleep(0.3)
        server.start()  # empty: the publisher must notice and republish its state
        await wait_until(lambda: matched(6, ("device",) * 5 + ("host",)))
        assert pub.resyncs >= 2 and pub.dropped == 0
        await pub.close()
        res = await reader.lookup(hs)  # a retired node's entries stop counting
        assert res is not None and res.nodes == {}
        await reader.close()

    asyncio.run(main())


def test_publisher_overflow_takes_a_new_epoch(server) -> None:
    hs = hashes(8)
    device = Tier()

    async def main() -> None:
        pub = KVEventPublisher(index(server), "n", PublisherConfig(interval_s=0.02,
                                                                   max_pending=4))
        pub.add_snapshot_source("device", device.snapshot)
        reader = index(server)
        await pub.step()
        first = pub.epoch
        device.held = hs[:3]
        pub.on_engine_events([BlockStored(tuple(hs), None)])  # 8 > 4: some dropped
        assert pub.dropped == 4
        await pub.step()
        res = await reader.lookup(hs)
        assert pub.epoch > first and res is not None and res.matched("n") == 3
        await pub.close()
        await reader.close()

    asyncio.run(main())


def test_a_restarted_node_s_old_entries_are_ignored(server) -> None:
    hs = hashes(6)
    device = Tier()

    async def main() -> None:
        reader = index(server)
        old = KVEventPublisher(index(server), "n", PublisherConfig(interval_s=0.02))
        old.add_snapshot_source("device", device.snapshot)
        device.held = hs
        await old.step()
        res = await reader.lookup(hs)
        assert res is not None and res.matched("n") == 6
        await old.close(retire=False)  # a crash: nothing retired
        device.held = hs[:2]  # what the restarted process holds
        new = KVEventPublisher(index(server), "n", PublisherConfig(interval_s=0.02))
        new.add_snapshot_source("device", device.snapshot)
        await new.step()
        assert new.epoch > old.epoch
        res = await reader.lookup(hs)
        assert res is not None and res.matched("n") == 2 and res.num_blocks == 2
        await new.close()
        await reader.close()

    asyncio.run(main())
