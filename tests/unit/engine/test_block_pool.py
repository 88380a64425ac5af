import pytest

from engine.block_hash import hash_blocks
from engine.block_pool import BlockPool, BlockRemoved, BlockStored
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


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
    pool.touch([pool.get_cached_block(h[0])])
    assert blk.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free([blk])
    with pytest.raises(RuntimeError):
        pool.free([blk])
    pool.check_integrity()


def test_unget_puts_untouched_blocks_back_as_they_were():
    """peek_free names what get_new_blocks takes; unget undoes it: same queue order,
    same cached hashes, so the next takes evict exactly what they would have."""
    pool = BlockPool(4)
    a = pool.get_new_blocks(4)
    hashes = hash_blocks(list(range(8)), 2)
    pool.cache_full_blocks(a, hashes, None)
    pool.free(reversed(a))  # queue: 3, 2, 1, 0, all cached
    pool.take_events()
    ahead = pool.peek_free(3)
    before = [b.block_hash for b in ahead]
    assert [b.block_id for b in ahead] == [3, 2, 1]
    assert pool.get_new_blocks(3) == ahead
    assert pool.take_events() == [BlockRemoved(tuple(before))]
    pool.unget(ahead[1:], before[1:])  # the last two were never written
    pool.check_integrity()
    assert pool.num_free_blocks == 3 and pool.get_cached_block(before[2]) is ahead[2]
    assert [b.block_id for b in pool.peek_free(3)] == [2, 1, 0]
    with pytest.raises(RuntimeError):
        pool.unget([ahead[1]], [None])  # not taken
    assert [b.block_hash for b in pool.get_new_blocks(2)] == [None, None]
    assert pool.take_events() == [BlockRemoved(tuple(before[1:]))]


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
