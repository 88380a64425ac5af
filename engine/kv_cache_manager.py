"""Per-request block tables over the block pool, with prefix caching.

The scheduler side of the KV cache: decides which blocks a request's tokens go to.
"""

from __future__ import annotations

from array import array

from engine.block_pool import BlockPool, KVBlock
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 pool: BlockPool | None = None) -> None:
        """`pool`: the block pool to manage (a BlockPool subclass's instance of
        `num_blocks`), else a new BlockPool."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching) if pool is None else pool
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # The same tables as int32 block ids, kept in step with `req_blocks`: the
        # runner's persistent batch copies a row from them when it changes
        # (engine/input_batch.py).
        self._req_ids: dict[str, array[int]] = {}
        self._num_cached: dict[str, int] = {}  # full blocks already in the hash map
        # Requests whose table grew, was replaced or freed since `take_changed` last
        # ran (the runner's persistent batch, engine/input_batch.py); None: no reader.
        self._changed: set[str] | None = None
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def usage(self) -> float:
        return self.pool.usage

    def holds(self, request_id: str) -> bool:
        return request_id in self.req_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (ids); [] if it holds none."""
        return list(self._req_ids.get(request_id, ()))

    def table(self, request_id: str) -> array[int] | None:
        """The request's block table (int32 ids) itself, None if it holds none. The
        same object until the table is freed or replaced (then a new one), appended to
        in place as it grows; the caller must not change it."""
        return self._req_ids.get(request_id)

    def take_changed(self) -> set[str]:
        """Request ids whose table grew, was replaced or freed since the last call
        (the first call starts the tracking and returns nothing)."""
        changed = self._changed
        self._changed = set()
        return changed or set()

    def _touched(self, request_id: str) -> None:
        if self._changed is not None:
            self._changed.add(request_id)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of `request`, as blocks (not yet referenced).

        At least one token is always left to compute: the last prompt token's logits
        are needed to sample.
        """
        if not self.enable_caching or request.wants_prompt_logprobs:
            return [], 0
        hashes = request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = self.pool.cached_prefix(hashes, max(max_blocks, 0))
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(blocks) * self.block_size
        return blocks, len(blocks) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> bool:
        """Makes room for `num_new_tokens` more tokens of `request`.

        # | computed | new computed (prefix hit) | new tokens | -> blocks needed
        Returns False (changing nothing) when the pool cannot supply the blocks.
        """
        blocks = self.req_blocks.get(request.request_id)
        if not new_computed_blocks and blocks is not None and \
                request.num_computed_tokens + num_new_tokens <= len(blocks) * self.block_size:
            return True  # most decode steps: the token fits in the last block
        new_computed_blocks = new_computed_blocks or []
        if blocks is None:
            blocks = self.req_blocks[request.request_id] = []
            self._req_ids[request.request_id] = array("i")
        total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size \
            + num_new_tokens
        num_new = cdiv(total, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Cached blocks with no holder sit in the free queue: touching them uses them up.
        num_revived = self.pool.num_unreferenced(new_computed_blocks)
        if max(num_new, 0) + num_revived > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request.request_id], self._req_ids[request.request_id]
                self._touched(request.request_id)
            return False
        self.pool.touch(new_computed_blocks)
        ids = self._req_ids[request.request_id]
        blocks.extend(new_computed_blocks)
        ids.extend(b.block_id for b in new_computed_blocks)
        if num_new > 0:
            new = self.pool.get_new_blocks(num_new)
            if new is None:  # cannot happen: counted above
                raise RuntimeError("block pool ran dry after a successful check")
            blocks.extend(new)
            ids.extend(b.block_id for b in new)
        if new_computed_blocks:
            self._num_cached[request.request_id] = len(blocks) - max(num_new, 0)
        self._touched(request.request_id)
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publishes the request's newly full, computed blocks to the prefix cache."""
        if not self.enable_caching:
            return
        start = self._num_cached.get(request.request_id, 0)
        if num_computed_tokens // self.block_size <= start:
            return  # most decode steps: no block became full
        blocks = self.req_blocks.get(request.request_id, [])
        end = min(num_computed_tokens // self.block_size, len(blocks))
        if end <= start:
            return
        hashes = request.update_block_hashes(self.block_size)
        parent = hashes[start - 1] if start else None
        self.pool.cache_full_blocks(
            blocks[start:end], hashes[start:end], parent,
            request.all_token_ids[start * self.block_size:end * self.block_size])
        self._num_cached[request.request_id] = end

    def can_fork(self) -> bool:
        return self.pool.num_free_blocks > 0

    def fork(self, parent: Request, child: Request, n: int) -> tuple[int, int] | None:
        """Gives `child` the parent's first `n` computed tokens' KV: full blocks shared (a
        reference each), the last partial block copied, since both append to it.

        # | shared full blocks (ref_cnt + 1) | partial block: a new block, copy of the parent's |
        Returns the (source, destination) block ids to copy, or None when the computed
        tokens fill whole blocks. The caller checked `can_fork` (one free block)."""
        blocks = self.req_blocks[parent.request_id]
        full = blocks[:n // self.block_size]
        self.pool.touch(full)
        mine = list(full)
        copy = None
        if n % self.block_size:
            new = self.pool.get_new_blocks(1)
            if new is None:
                raise RuntimeError("fork without a free block (call can_fork first)")
            copy = (blocks[len(full)].block_id, new[0].block_id)
            mine += new
        self.req_blocks[child.request_id] = mine
        self._req_ids[child.request_id] = array("i", [b.block_id for b in mine])
        self._num_cached[child.request_id] = min(self._num_cached.get(parent.request_id, 0),
                                                 len(full))
        self._touched(child.request_id)
        return copy

    def set_blocks(self, request_id: str, blocks: list[KVBlock]) -> None:
        """Replaces the block table of a request that holds one, references unchanged:
        for a caller that hands out blocks the pool already gave (the simulator's decode
        windows)."""
        self.req_blocks[request_id][:] = blocks
        self._req_ids[request_id] = array("i", [b.block_id for b in blocks])
        self._touched(request_id)

    def free(self, request: Request) -> None:
        """Releases the request's blocks (tail first, so its prefix is evicted last)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._req_ids.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        self._touched(request.request_id)
        self.pool.free(reversed(blocks))

    def check_integrity(self, other_holders: dict[int, int] | None = None) -> None:
        """`other_holders`: references held outside requests (block_id -> count)."""
        self.pool.check_integrity()
        held: dict[int, int] = dict(other_holders or {})
        assert self._req_ids == {r: array("i", [b.block_id for b in blocks])
                                 for r, blocks in self.req_blocks.items()}, \
            "block id tables out of step with the block tables"
        for blocks in self.req_blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == held.get(block.block_id, 0), \
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != holders"
