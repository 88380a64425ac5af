"""The block pool: who holds which KV block, and which free blocks still hold a
cached prefix. Pure bookkeeping (no tensors): the KV bytes live in one block-major
tensor owned by the model runner, indexed by `block_id`.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.block_hash import BlockHash


@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]


KVEvent = BlockStored | BlockRemoved


class BlockPool:
    """Ref-counted blocks, an LRU free queue and a hash -> block map.

    A block with `ref_cnt == 0` sits in the free queue; if it still has a hash its KV
    is a cached prefix that `touch` can revive until `get_new_blocks` reuses (evicts)
    it. Blocks freed last are reused last, so recently used prefixes survive longest.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVEvent] = []
        # Newly cached blocks for an offload connector (engine/offload.py), if tracked.
        self.track_new_cached = False
        self._new_cached: list[tuple[KVBlock, BlockHash]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-evictable ones included)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock] | None:
        """Takes `n` blocks off the free queue (evicting their cached hashes).

        Returns blocks with ref_cnt 1 that the caller owns and must `free`, or None
        when fewer than `n` are free.
        """
        if n > len(self._free):
            return None
        out = []
        evicted = []
        for _ in range(n):
            block = self.blocks[self._free.popitem(last=False)[0]]
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        return out

    def peek_free(self, n: int) -> list[KVBlock]:
        """The next `n` blocks `get_new_blocks` would hand out, in that order (not taken)."""
        return [self.blocks[i] for i in itertools.islice(self._free, n)]

    def unget(self, blocks: Sequence[KVBlock], hashes: Sequence[BlockHash | None]) -> None:
        """Undoes `get_new_blocks` for blocks nothing wrote: they go back to the head of
        the free queue in order, each holding again the cached hash it was taken with
        (its KV is untouched), as if never taken. No event: the caller publishes the
        evictions it keeps (the simulator's decode windows, sim/worker.py)."""
        for block, h in zip(reversed(blocks), reversed(hashes), strict=True):
            if block.ref_cnt != 1 or block.block_hash is not None:
                raise RuntimeError(f"unget of block {block.block_id}: in use or cached")
            block.ref_cnt = 0
            self._free[block.block_id] = None
            self._free.move_to_end(block.block_id, last=False)
            if h is not None:
                if h in self._cached:
                    raise RuntimeError(f"unget of block {block.block_id}: hash cached again")
                block.block_hash = h
                self._cached[h] = block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes a reference on (cached) blocks, reviving them from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference per block; unreferenced blocks join the free queue's tail.

        Pass a request's blocks in reverse so its tail blocks are evicted first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache_full_blocks(self, blocks: Sequence[KVBlock], hashes: Sequence[BlockHash],
                          parent_hash: BlockHash | None) -> None:
        """Marks full, computed blocks as holding the KV for `hashes` (same order)."""
        if not self.enable_caching:
            return
        stored = []
        for block, h in zip(blocks, hashes, strict=True):
            if block.block_hash is not None:
                continue  # already cached (a prefix hit)
            if h in self._cached:
                continue  # another block holds this content; keep the first
            block.block_hash = h
            self._cached[h] = block
            stored.append(h)
            if self.track_new_cached:
                self._new_cached.append((block, h))
        if stored:
            self._events.append(BlockStored(tuple(stored), parent_hash))

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash of a free block (e.g. after a weight change)."""
        removed = []
        for h, block in list(self._cached.items()):
            if block.ref_cnt == 0:
                removed.append(h)
                del self._cached[h]
                block.block_hash = None
        if removed:
            self._events.append(BlockRemoved(tuple(removed)))

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the pool holds KV for (in use or evictable), e.g. for an index
        snapshot; read it on the engine's thread."""
        return list(self._cached)

    def take_new_cached(self) -> list[KVBlock]:
        """Blocks cached since the last call that still hold that content."""
        new, self._new_cached = self._new_cached, []
        return [b for b, h in new if b.block_hash == h]

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Raises AssertionError if the pool's invariants are broken."""
        assert len(self._free) == sum(b.ref_cnt == 0 for b in self.blocks), "free queue size"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} ref_cnt < 0"
            assert (block.block_id in self._free) == (block.ref_cnt == 0), \
                f"block {block.block_id} free-queue membership"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, \
                    f"block {block.block_id} hash not mapped"
        for h, block in self._cached.items():
            assert block.block_hash == h, "cached map points at a block with another hash"
