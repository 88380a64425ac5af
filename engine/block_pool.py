"""The block pool: who holds which KV block, and which free blocks still hold a
cached prefix. Pure bookkeeping (no tensors): the KV bytes live in one block-major
tensor owned by the model runner, indexed by `block_id`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import islice, takewhile
from operator import is_not
from typing import cast

from engine.block_hash import BlockHash


@dataclass(eq=False, slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # its entries in the pool's free queue; the last one is live while ref_cnt == 0
    queued: int = field(default=0, repr=False)


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    # The stored blocks' token ids, block after block (empty when the caller had only
    # hashes, e.g. blocks loaded from an offload tier).
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]


KVEvent = BlockStored | BlockRemoved

_not_none = partial(is_not, None)


class BlockPool:
    """Ref-counted blocks, an LRU free queue and a hash -> block map.

    A block with `ref_cnt == 0` sits in the free queue; if it still has a hash its KV
    is a cached prefix that `touch` can revive until `get_new_blocks` reuses (evicts)
    it. Blocks freed last are reused last, so recently used prefixes survive longest.

    The free queue is a deque with lazy removal (per block, the memory it touches is the
    block and a deque slot, where an OrderedDict's is a node and a hash table): `touch`
    leaves the block's entry in place, stale, and a freed block is appended again. A
    block's live entry is its last one (`queued` counts them) while its ref_cnt is 0;
    `get_new_blocks` skips stale entries. So the live entries are in the order an LRU
    queue with removal would hold.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i, queued=1) for i in range(num_blocks)]
        self._queue: deque[KVBlock] = deque(self.blocks)
        self._num_free = num_blocks
        self._cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVEvent] = []
        # Newly cached blocks for an offload connector (engine/offload.py), if tracked.
        self.track_new_cached = False
        self._new_cached: list[tuple[KVBlock, BlockHash]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-evictable ones included)."""
        return self._num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cached_prefix(self, hashes: Iterable[BlockHash], limit: int | None = None) -> list[KVBlock]:
        """The blocks holding `hashes[:limit]`, up to the first one not cached."""
        # C-level: map looks each hash up, takewhile stops at the first miss (None)
        get: Callable[[BlockHash], KVBlock | None] = self._cached.get
        return cast(list[KVBlock], list(takewhile(_not_none, map(get, islice(hashes, limit)))))

    def get_new_blocks(self, n: int) -> list[KVBlock] | None:
        """Takes `n` blocks off the free queue (evicting their cached hashes).

        Returns blocks with ref_cnt 1 that the caller owns and must `free`, or None
        when fewer than `n` are free.
        """
        if n > self._num_free:
            return None
        popleft = self._queue.popleft
        cached = self._cached
        out = []
        evicted = []
        for _ in range(n):
            block = popleft()
            block.queued -= 1
            while block.queued or block.ref_cnt:  # a stale entry (see the class)
                block = popleft()
                block.queued -= 1
            block.ref_cnt = 1
            h = block.block_hash
            if h is not None:
                evicted.append(h)
                del cached[h]
                block.block_hash = None
            out.append(block)
        self._num_free -= n
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        return out

    def num_unreferenced(self, blocks: Iterable[KVBlock]) -> int:
        """How many of `blocks` (cached) no request holds: touching them takes as many
        off the free queue."""
        n = 0
        for block in blocks:
            if not block.ref_cnt:
                n += 1
        return n

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Takes a reference on (cached) blocks, reviving them from the free queue."""
        revived = 0
        try:
            for block in blocks:
                if block.ref_cnt == 0:
                    revived += 1  # its queue entry goes stale
                block.ref_cnt += 1
        finally:
            self._num_free -= revived

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference per block; unreferenced blocks join the free queue's tail.

        Pass a request's blocks in reverse so its tail blocks are evicted first.
        """
        append = self._queue.append
        freed = 0
        try:
            for block in blocks:
                ref_cnt = block.ref_cnt
                if ref_cnt == 1:
                    block.ref_cnt = 0
                    block.queued += 1
                    append(block)
                    freed += 1
                elif ref_cnt > 1:
                    block.ref_cnt = ref_cnt - 1
                else:
                    raise RuntimeError(f"double free of block {block.block_id}")
        finally:
            self._num_free += freed
        if len(self._queue) > 2 * self.num_blocks:  # mostly stale: bound its memory
            self._compact()

    def _compact(self) -> None:
        """Drops the free queue's stale entries (order kept)."""
        live = []
        for block in self._queue:
            block.queued -= 1
            if not block.queued and not block.ref_cnt:
                live.append(block)
        for block in live:
            block.queued = 1
        self._queue = deque(live)

    def cache_full_blocks(self, blocks: Sequence[KVBlock], hashes: Sequence[BlockHash],
                          parent_hash: BlockHash | None,
                          token_ids: Sequence[int] | None = None) -> None:
        """Marks full, computed blocks as holding the KV for `hashes` (same order).
        `token_ids`: the blocks' tokens, block after block (for the BlockStored event)."""
        if not self.enable_caching:
            return
        cached = self._cached
        track = self.track_new_cached
        stored = []
        tokens: list[int] = []
        size = len(token_ids) // len(blocks) if token_ids and blocks else 0
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=True)):
            # skip: already cached (a prefix hit), or another block holds this content
            # (keep the first; one probe of the map either way)
            if block.block_hash is None and cached.setdefault(h, block) is block:
                block.block_hash = h
                stored.append(h)
                if size:
                    tokens += token_ids[i * size:(i + 1) * size]  # type: ignore[index]
                if track:
                    self._new_cached.append((block, h))
        if stored:
            self._events.append(BlockStored(tuple(stored), parent_hash, tuple(tokens)))

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
        assert self._num_free == sum(b.ref_cnt == 0 for b in self.blocks), "free count"
        entries: dict[int, int] = {}
        for block in self._queue:
            entries[block.block_id] = entries.get(block.block_id, 0) + 1
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} ref_cnt < 0"
            assert block.queued == entries.get(block.block_id, 0), \
                f"block {block.block_id} free-queue entries"
            assert block.ref_cnt or block.queued, f"free block {block.block_id} not queued"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, \
                    f"block {block.block_id} hash not mapped"
        for h, block in self._cached.items():
            assert block.block_hash == h, "cached map points at a block with another hash"
