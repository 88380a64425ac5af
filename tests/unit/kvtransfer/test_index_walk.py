"""The server-side walk of the block index (index_walk.WALK, one Lua script) gives the client-side
walk's answer (kvtransfer/index_pywalk.py, the reference) for every state: random
histories of stores, removals, restarts (new epochs), snapshots under way, retirements
and garbage fields, replayed into a real redis-server and queried with random prompts
and node filters, the runs compared in order, the stale entries too."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis

from engine.block_hash import BlockHash, hash_blocks, make_extra_key
from kvtransfer.index import IndexConfig, IndexLookup, RedisBlockIndex
from kvtransfer.index_pywalk import python_walk
from tests.redis_server import RedisServer, running_redis

MODEL = "walk"
BS = 4
TIERS = ("device", "host", "disk", "lmcache")


@pytest.fixture(scope="module")
def server():
    with running_redis() as s:
        yield s


def chains(n: int, depth: int) -> list[list[BlockHash]]:
    """n prompts of `depth` blocks; prompt k shares its first k blocks with prompt 0."""
    base = list(range(depth * BS))
    out = []
    for k in range(n):
        tokens = base[:k * BS] + [10_000 * (k + 1) + t for t in range(k * BS, depth * BS)]
        out.append(hash_blocks(tokens, BS, make_extra_key(MODEL)))
    return out


def index(server: RedisServer, **kw) -> RedisBlockIndex:
    return RedisBlockIndex(server.url, MODEL, IndexConfig(timeout_ms=5000, **kw))


async def assert_same(idx: RedisBlockIndex, hashes: list[BlockHash],
                      nodes: set[str] | None, max_stale: int = 10_000
                      ) -> tuple[IndexLookup, int]:
    want, want_stale = await python_walk(idx, hashes, nodes, first_chunk=2)
    got, got_stale = await idx._walk(hashes, nodes, max_stale)
    assert got == want
    assert list(got.nodes) == list(want.nodes)  # the same order, too
    assert got_stale == want_stale[:max_stale]
    return got, len(got_stale)


class History:
    """Random writers: each node stores and removes runs of blocks, restarts under a new
    epoch, writes a snapshot under an epoch not registered yet, or retires."""

    def __init__(self, idx: RedisBlockIndex, raw: redis.Redis, rng: random.Random,
                 prompts: list[list[BlockHash]], nodes: list[str]) -> None:
        self.idx, self.raw, self.rng, self.prompts = idx, raw, rng, prompts
        self.epoch = {n: 1 for n in nodes}
        self.clock = 1

    async def setup(self) -> None:
        for node in self.epoch:
            await self.idx.register(node, 1)

    async def step(self) -> None:
        rng, node = self.rng, self.rng.choice(list(self.epoch))
        prompt = rng.choice(self.prompts)
        lo = rng.randrange(len(prompt))
        blocks = prompt[lo:lo + rng.randint(1, 6)]
        op = rng.random()
        if op < 0.45:
            tier = rng.choice(TIERS)
            await self.idx.apply(node, self.epoch[node], stored=[(h, tier) for h in blocks],
                                 check=False)
        elif op < 0.7:
            tier = rng.choice(TIERS)
            await self.idx.apply(node, self.epoch[node], removed=[(h, tier) for h in blocks],
                                 check=False)
        elif op < 0.8:  # a restart: everything it wrote so far is stale now
            self.clock += 1
            self.epoch[node] = self.clock
            await self.idx.register(node, self.clock)
        elif op < 0.87:  # a snapshot under an epoch still to be registered: skipped
            await self.idx.apply(node, self.clock + 1, stored=[(h, "device") for h in blocks],
                                 check=False)
        elif op < 0.92:  # retired: its entries count for nothing, and are not stale
            await self.idx.retire(node, self.epoch[node])
        elif op < 0.94:  # re-registered after a retirement
            await self.idx.register(node, self.epoch[node])
        else:  # garbage a reader must survive: no node, an empty one, a bad epoch
            field = rng.choice(["nodeless", "@device", f"{node}@device", f"{node}@@host"])
            epoch = self.epoch[node]  # " 5 " is epoch 5 to int(): current, not stale
            value = rng.choice(["junk", str(epoch), "-3", f" {epoch} ", f"0{epoch - 1}"])
            self.raw.hset(self.idx.block_key(rng.choice(prompt[:3])), field, value)


def test_server_walk_equals_the_python_walk_on_random_histories(server) -> None:
    rng = random.Random(20261124)
    nodes = ["n0", "n1", "n2", "n3", "a@b", "x y"]

    async def main() -> None:
        raw = redis.Redis.from_url(server.url, decode_responses=True)
        raw.flushall()
        prompts = chains(4, 10)
        idx = index(server, walk_blocks=3)  # runs cross stretches: continuation calls
        one_call = index(server)
        history = History(idx, raw, rng, prompts, nodes)
        await history.setup()
        runs = tiered = stale = 0
        for step in range(400):
            await history.step()
            if step % 4:
                continue
            for _ in range(3):
                prompt = rng.choice(prompts)[:rng.randint(0, 10)]
                allowed = rng.choice([None, None, set(rng.sample(nodes, 3)), set(), {"ghost"}])
                got, n_stale = await assert_same(idx, prompt, allowed)
                assert await assert_same(one_call, prompt, allowed) == (got, n_stale)
                await assert_same(idx, prompt, allowed, max_stale=rng.randint(0, 3))
                runs += bool(got.nodes)
                tiered += any(t != "device" for r in got.nodes.values() for t in r)
                stale += bool(n_stale)
        assert runs > 50 and tiered > 20 and stale > 20  # the histories were worth replaying
        await idx.close()
        await one_call.close()

    asyncio.run(main())


def test_server_walk_equals_the_python_walk_with_hundreds_of_holders(server) -> None:
    """Past 128 fields a hash's HGETALL order is the hash table's: both walks see it."""
    rng = random.Random(7)
    nodes = [f"w{i}" for i in range(300)]

    async def main() -> None:
        redis.Redis.from_url(server.url).flushall()
        prompt = chains(1, 12)[0]
        idx = index(server, walk_blocks=5)
        for n in nodes:
            epoch = rng.choice([1, 2])
            await idx.register(n, 2)
            depth = rng.choice([0, 3, 12, 12, 12])
            stored = [(h, "device") for h in prompt[:depth]]
            stored += [(prompt[rng.randrange(12)], rng.choice(TIERS)) for _ in range(2)]
            await idx.apply(n, epoch, stored=stored, check=False)
        for allowed in (None, set(rng.sample(nodes, 40))):
            got, n_stale = await assert_same(idx, prompt, allowed)
            assert got.num_blocks == 12 and n_stale > 0
            assert len(got.nodes) > len(allowed or nodes) // 4
        await idx.close()

    asyncio.run(main())


def test_long_runs_take_bounded_calls_and_a_flushed_script_is_loaded_again(server) -> None:
    hs, other = chains(2, 10)
    raw = redis.Redis.from_url(server.url)

    async def main() -> None:
        raw.flushall()
        idx = index(server, walk_blocks=4)
        await idx.register("a", 1)
        await idx.register("b", 1)
        await idx.apply("a", 1, stored=[(h, "device") for h in hs] + [(hs[5], "host")])
        await idx.apply("b", 1, stored=[(h, "disk") for h in hs[:6]])
        await idx.lookup(hs[:1])  # the script is loaded (on a NOSCRIPT) before counting
        raw.config_resetstat()
        res = await idx.lookup(hs)
        assert res == IndexLookup(10, {"a": ("device",) * 10, "b": ("disk",) * 6})
        stats = raw.info("commandstats")
        assert int(stats["cmdstat_evalsha"]["calls"]) == 3  # blocks [0, 4) [4, 8) [8, 10)
        raw.script_flush()  # NOSCRIPT: the client loads it again and retries
        assert await idx.lookup(hs) == res
        missing = hs[:3] + [other[3]] + hs[4:]  # nobody holds block 3: the walk ends there
        assert await idx.lookup(missing) == IndexLookup(3, {"a": ("device",) * 3,
                                                            "b": ("disk",) * 3})
        await idx.close()

    asyncio.run(main())


def test_odd_fields_and_epoch_spellings_are_read_as_the_python_walk_reads_them(server) -> None:
    hs = chains(1, 2)[0]
    raw = redis.Redis.from_url(server.url, decode_responses=True)

    async def main() -> None:
        raw.flushall()
        idx = index(server)
        await idx.register("a", 5)
        await idx.register("b@x", 5)
        await idx.register("c", 5)
        await idx.apply("a", 5, stored=[(h, "disk") for h in hs])
        raw.hset(idx.block_key(hs[0]), mapping={
            "a@host": " 5 ",  # int() reads 5: not older, not current (a string compare)
            "a@device": "05", "a@lmcache": "4", "a@weird": "junk", "a@new": "6",
            "b@x@device": "5", "b@x@host": "3", "nodeless": "5", "@device": "5",
            "c@zeta": "5", "c@alpha": "5"})  # two tiers of equal rank: the first one met
        res, stale = await assert_same(idx, hs, None)
        assert res == IndexLookup(2, {"a": ("disk", "disk"), "b@x": ("device",),
                                      "c": ("zeta",)})
        assert stale == 3  # "4", "junk", "b@x"'s "3"
        await idx.close()

    asyncio.run(main())
