import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest

from engine.block_hash import hash_blocks
from engine.block_pool import BlockPool, BlockRemoved, BlockStored
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def free_order(pool: BlockPool, n: int | None = None) -> list[int]:
    """The ids of the next `n` blocks get_new_blocks would hand out, in order: each free
    block's live (last) entry in the free queue (BlockPool's docstring)."""
    out: list[int] = []
    seen: dict[int, int] = {}
    for block in pool._queue:
        if block.ref_cnt:
            continue
        k = seen[block.block_id] = seen.get(block.block_id, 0) + 1
        if k == block.queued:
            out.append(block.block_id)
    return out[:n]


def make_request(rid: str, n: int, offset: int = 0) -> Request:
    return Request(rid, [offset + i for i in range(n)], SamplingParams(max_tokens=4))


def test_alloc_free_lru_and_events():
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2] and pool.num_free_blocks == 1
    assert pool.get_new_blocks(2) is None  # "not now", nothing changed
    assert pool.num_free_blocks == 1
    hashes = hash_blocks(list(range(8)), 4)
    pool.cache_full_blocks(a[:2], hashes, None)
    assert pool.take_events() == [BlockStored(tuple(hashes), None)]
    pool.free(reversed(a))
    pool.check_integrity()
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    # Free queue order: 3 (never used), then 2, 1, 0 (freed tail first).
    b = pool.get_new_blocks(2)
    assert [x.block_id for x in b] == [3, 2]
    assert pool.take_events() == []  # neither held a hash
    c = pool.get_new_blocks(1)
    assert c[0].block_id == 1
    assert pool.take_events() == [BlockRemoved((hashes[1],))]
    assert pool.get_cached_block(hashes[0]) is a[0]
    pool.check_integrity()


def test_touch_revives_cached_block_and_double_free_is_an_error():
    pool = BlockPool(2)
    (blk,) = pool.get_new_blocks(1)
    h = hash_blocks([1, 2], 2)
    pool.cache_full_blocks([blk], h, None)
    pool.free([blk])
    assert pool.num_unreferenced([blk]) == 1  # touching it takes it off the free queue
    pool.touch([pool.get_cached_block(h[0])])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 1
    assert pool.num_unreferenced([blk]) == 0
    pool.free([blk])
    with pytest.raises(RuntimeError):
        pool.free([blk])
    pool.check_integrity()


def test_manager_prefix_hit_shares_blocks_and_leaves_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    r1 = make_request("a", 10)
    assert kv.allocate_slots(r1, 10)
    r1.num_computed_tokens = 10
    kv.cache_blocks(r1, 10)
    r2 = make_request("b", 12)  # shares the first 8 tokens (two full blocks)
    r2.all_token_ids[10:] = [99, 98]
    blocks, hit = kv.get_computed_blocks(r2)
    assert hit == 8 and [b.block_id for b in blocks] == kv.block_ids("a")[:2]
    assert kv.allocate_slots(r2, 4, blocks)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.pool.blocks[kv.block_ids("a")[0]].ref_cnt == 2
    # An exact repeat of a block-aligned prompt still computes its last block.
    r3 = make_request("c", 8)
    _, hit3 = kv.get_computed_blocks(r3)
    assert hit3 == 4
    kv.check_integrity()
    kv.free(r1)
    kv.free(r2)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == 16  # free + evictable-cached == total


def test_allocate_fails_cleanly_when_full():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = make_request("a", 12)
    assert not kv.allocate_slots(r, 12)
    assert kv.block_ids("a") == [] and kv.pool.num_free_blocks == 2
    kv.check_integrity()


class RefPool:
    """The pool's semantics, written the plain way (an OrderedDict free queue, one block
    at a time): the model the fast BlockPool must match operation for operation."""

    def __init__(self, n: int) -> None:
        self.ref = [0] * n
        self.hash: list[object] = [None] * n
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n))
        self.cached: dict[object, int] = {}
        self.events: list[object] = []

    def get_new_blocks(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out, evicted = [], []
        for _ in range(n):
            i = self.free.popitem(last=False)[0]
            if self.hash[i] is not None:
                evicted.append(self.hash[i])
                del self.cached[self.hash[i]]
                self.hash[i] = None
            self.ref[i] = 1
            out.append(i)
        if evicted:
            self.events.append(BlockRemoved(tuple(evicted)))
        return out

    def free_(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref[i] <= 0:
                raise RuntimeError("double free")
            self.ref[i] -= 1
            if self.ref[i] == 0:
                self.free[i] = None

    def touch(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref[i] == 0:
                del self.free[i]
            self.ref[i] += 1

    def cache(self, ids: list[int], hashes: list[object], parent: object) -> None:
        stored = []
        for i, h in zip(ids, hashes, strict=True):
            if self.hash[i] is None and h not in self.cached:
                self.hash[i] = h
                self.cached[h] = i
                stored.append(h)
        if stored:
            self.events.append(BlockStored(tuple(stored), parent))

    def unget(self, ids: list[int], hashes: list[object]) -> None:
        for i, h in zip(reversed(ids), reversed(hashes), strict=True):
            self.ref[i] = 0
            self.free[i] = None
            self.free.move_to_end(i, last=False)
            if h is not None:
                self.hash[i] = h
                self.cached[h] = i

    def prefix(self, hashes: list[object], limit: int) -> list[int]:
        out = []
        for h in hashes[:limit]:
            if h not in self.cached:
                break
            out.append(self.cached[h])
        return out


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_match_the_reference_model(seed: int):
    """Random sequences of every pool operation (shared blocks, prefix hits revived from
    the free queue, hash collisions, repeated blocks, double frees, resets), compared
    after each step with RefPool: blocks handed out, free-queue order, ref counts, hash
    map contents and order, events, errors."""
    random_operations(seed, BlockPool)


def random_operations(seed: int, make_pool: Callable[[int], Any], ungets: bool = False
                      ) -> None:
    """The reference-model comparison on a pool from `make_pool(n)`; `ungets`: its
    `unget` (sim/pool.py's) in the mix too."""
    rng = random.Random(seed)
    n = rng.choice([3, 8, 40])
    pool, ref = make_pool(n), RefPool(n)
    held: list[list[int]] = []  # block-id lists someone holds a reference on
    hash_space = [f"h{i}" for i in range(rng.choice([4, 3 * n]))]

    def ids(blocks):
        return [b.block_id for b in blocks]

    for _ in range(500):
        op = rng.random()
        if op < 0.25:
            k = rng.randint(0, n // 2 + 1)
            got, want = pool.get_new_blocks(k), ref.get_new_blocks(k)
            assert (None if got is None else ids(got)) == want
            if want:
                held.append(want)
        elif op < 0.45 and held:
            lst = held.pop(rng.randrange(len(held)))
            order = list(reversed(lst)) if rng.random() < 0.7 else rng.sample(lst, len(lst))
            if rng.random() < 0.05 and order:
                order.append(order[0])  # a double free: both raise, at the same point
            err_pool = err_ref = None
            try:
                pool.free(iter([pool.blocks[i] for i in order]))
            except RuntimeError as e:
                err_pool = e
            try:
                ref.free_(order)
            except RuntimeError as e:
                err_ref = e
            assert (err_pool is None) == (err_ref is None)  # the same state after, too
        elif op < 0.6 and held:
            lst = rng.choice(held)
            m = rng.randint(0, len(lst))
            hs = [rng.choice(hash_space) for _ in range(m)]
            blocks = [pool.blocks[i] for i in lst[:m]]
            if rng.random() < 0.1 and m:
                blocks[-1], hs_ids = blocks[0], lst[:m - 1] + lst[:1]  # a block twice
            else:
                hs_ids = lst[:m]
            parent = rng.choice([None, "p"])
            pool.cache_full_blocks(blocks, hs, parent)
            ref.cache(hs_ids, hs, parent)
        elif op < 0.75:
            # a request's prefix lookup, then the hit blocks are touched (revived)
            hs = rng.sample(hash_space, min(len(hash_space), rng.randint(0, 6)))
            limit = rng.randint(0, len(hs))
            got = ids(pool.cached_prefix(hs, limit))
            assert got == ref.prefix(hs, limit)
            if got:
                if rng.random() < 0.2:
                    got = got + got[:1]  # touched twice: two references
                pool.touch([pool.blocks[i] for i in got])
                ref.touch(got)
                held.append(got)
        elif op < 0.85:
            k = rng.randint(0, n)
            assert free_order(pool, k) == list(ref.free)[:k]
        elif op < 0.95 and ungets:
            # unget: take blocks, then give them back untouched with their old hashes
            k = rng.randint(1, max(1, len(ref.free) // 2))
            ahead = list(ref.free)[:k]
            old = [ref.hash[i] for i in ahead]
            if len(ahead) < k:
                continue
            assert ids(pool.peek_free(k)) == free_order(pool, k) == ahead
            assert ids(pool.get_new_blocks(k)) == ref.get_new_blocks(k) == ahead
            pool.take_events()
            ref.events.clear()
            keep = rng.randint(0, k)
            pool.unget([pool.blocks[i] for i in ahead[keep:]], old[keep:])
            ref.unget(ahead[keep:], old[keep:])
            if ahead[:keep]:
                held.append(ahead[:keep])
        else:
            pool.reset_prefix_cache()
            removed = [h for h, i in ref.cached.items() if ref.ref[i] == 0]
            for h in removed:
                ref.hash[ref.cached.pop(h)] = None
            if removed:
                ref.events.append(BlockRemoved(tuple(removed)))
        assert pool.take_events() == ref.events
        ref.events = []
        assert pool.num_free_blocks == len(ref.free)
        assert free_order(pool) == list(ref.free)
        assert [b.ref_cnt for b in pool.blocks] == ref.ref
        assert [b.block_hash for b in pool.blocks] == ref.hash
        assert pool.cached_hashes() == list(ref.cached)
        pool.check_integrity()
