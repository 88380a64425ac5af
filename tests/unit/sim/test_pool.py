"""The simulator's block pool (sim/pool.py): the engine's BlockPool plus a decode
window's peek at the blocks the next takes hand out and its give-back of blocks a cut
left unwritten, held to the same reference model as the engine's pool."""

import pytest

from engine.block_hash import hash_blocks
from engine.block_pool import BlockRemoved
from sim.pool import SimBlockPool as BlockPool
from tests.unit.engine.test_block_pool import random_operations


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


def test_stale_queue_entries_are_skipped_and_unget_of_a_touched_block():
    """A touched block leaves a stale entry in the free queue (class docstring): the
    next takes skip it, and unget puts such a block back at the head once."""
    pool = BlockPool(4)
    a = pool.get_new_blocks(4)
    pool.free(a)  # queue: 0 1 2 3
    pool.touch([a[1]])  # queue: 0 (1 stale) 2 3
    pool.free([a[1]])  # queue: 0 2 3 1
    pool.touch([a[3]])
    pool.unget([a[3]], [None])  # queue: 3 0 2 1
    assert [b.block_id for b in pool.peek_free(4)] == [3, 0, 2, 1]
    pool.check_integrity()
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 0, 2, 1]
    pool.check_integrity()


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_with_ungets_match_the_reference_model(seed: int):
    """The engine pool's reference-model comparison (tests/unit/engine), with ungets:
    take blocks, give some back untouched with their old hashes."""
    random_operations(seed, BlockPool, ungets=True)
