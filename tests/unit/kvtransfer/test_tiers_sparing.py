"""Sole-copy sparing from the Redis block index (kvtransfer/tiers/sparing.py) against a
real redis-server: two nodes publish their tier blocks; on node a, the block no other
node holds survives eviction while blocks node b also holds go. A stale view (Redis
gone) spares nothing, so eviction never waits."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kvtransfer.index import IndexConfig, RedisBlockIndex
from kvtransfer.tiers import TierConfig
from kvtransfer.tiers.manager import TieredCache
from kvtransfer.tiers.sparing import (
    SoleCopyView,
    SparingConfig,
    eviction_candidates,
    start_sole_copy_sparing,
)
from tests.redis_server import RedisServer
from tests.unit.kvtransfer.test_tiers import LAYOUT, make_blocks
from worker.kv_events import KVEventPublisher

MODEL = "tiny"


def node(server: RedisServer, name: str, host_blocks: int
         ) -> tuple[TieredCache, KVEventPublisher, RedisBlockIndex]:
    """A node's host tier publishing to the index (generous deadline: a busy CI box)."""
    idx = RedisBlockIndex(server.url, MODEL, IndexConfig(timeout_ms=2000))
    pub = KVEventPublisher(idx, name)
    tiers = TieredCache(TierConfig(host_blocks=host_blocks, pin_memory=False), LAYOUT)
    tiers.attach_publisher(pub)
    return tiers, pub, idx


def test_config_and_candidates() -> None:
    with pytest.raises(ValueError):
        SparingConfig(max_age_s=0)
    with pytest.raises(ValueError):
        SparingConfig(per_tier=0)
    hs, _ = make_blocks(4)
    holdings = [(hs[0], "host"), (hs[1], "host"), (hs[2], "disk"), (hs[3], "disk")]
    assert eviction_candidates(holdings, 1) == [hs[0], hs[2]]  # each tier's LRU end


def test_sole_copy_survives_eviction_while_shared_blocks_go() -> None:
    server = RedisServer().start()
    hs, data = make_blocks(6, seed=7)
    now = [100.0]
    a, pub_a, idx_a = node(server, "a", host_blocks=3)
    b, pub_b, _ = node(server, "b", host_blocks=8)

    async def main() -> None:
        a.put(hs[:3], list(data[:3]))  # LRU order on a: h0, h1, h2
        b.put([hs[0], hs[2]], [data[0], data[2]])  # b also holds h0 and h2
        await pub_a.step()
        await pub_b.step()
        view = SoleCopyView(idx_a, "a", a.holdings, SparingConfig(max_age_s=5.0),
                            clock=lambda: now[0])
        assert not view(hs[1])  # never refreshed: nothing spared
        assert await view.refresh()
        assert [view(h) for h in hs[:3]] == [False, True, False] and len(view) == 1
        # Plain LRU would take the sole copy h1 second:
        assert a.tiers[0].victims(2) == [hs[0], hs[1]]
        a.spare = view
        a.put(hs[3:5], list(data[3:5]))  # two evictions on a full tier
        assert [a.lookup([h]) for h in hs[:5]] == [0, 1, 0, 1, 1]
        out = torch.zeros_like(data[1])
        assert a.tiers[0].get([hs[1]], [out]) == 1 and torch.equal(out, data[1])
        await pub_a.step()  # the index follows a's evictions
        holders = await idx_a.holders(hs[:5])
        assert holders == {hs[0]: {"b"}, hs[1]: {"a"}, hs[2]: {"b"}, hs[3]: {"a"},
                           hs[4]: {"a"}}
        # Every candidate is a sole copy now: eviction still goes ahead, LRU first (the
        # get above made h1 the most recent, so h3 is the oldest).
        assert await view.refresh() and len(view) == 3
        a.put(hs[5:6], list(data[5:6]))
        assert [a.lookup([h]) for h in (hs[3], hs[4], hs[1], hs[5])] == [0, 1, 1, 1]
        # Redis gone: refresh fails, the view ages out and spares nothing.
        server.kill()
        assert view(hs[3])
        assert not await view.refresh() and view.failures == 1
        now[0] += 5.1
        assert not view(hs[3]) and len(view) == 0
        await pub_a.close()
        await pub_b.close()

    try:
        asyncio.run(main())
        a.check_integrity()
    finally:
        a.close()
        b.close()
        server.kill()


def test_started_view_refreshes_on_the_loop_and_closes() -> None:
    server = RedisServer().start()
    hs, data = make_blocks(2, seed=9)
    a, pub_a, idx_a = node(server, "a", host_blocks=4)

    async def main() -> None:
        a.put(hs, list(data))
        await pub_a.step()
        view = start_sole_copy_sparing(a, idx_a, "a", SparingConfig(interval_s=0.02))
        assert a.spare is view
        deadline = time.monotonic() + 10.0
        while view.refreshes < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert view.refreshes >= 2 and view(hs[0]) and view(hs[1])
        await view.close()
        n = view.refreshes
        await asyncio.sleep(0.1)
        assert view.refreshes == n  # the task is gone
        await pub_a.close()

    try:
        asyncio.run(main())
    finally:
        a.close()
        server.kill()
