"""The block pool the simulated workers run: the engine's BlockPool, plus the two steps
a decode window (sim/window.py) needs to stand for several one-iteration steps at once:
naming the blocks the next takes would hand out (`peek_free`), and giving back blocks
taken for iterations a cut removed (`unget`), as if never taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.block_pool import BlockPool, KVBlock


class SimBlockPool(BlockPool):
    def peek_free(self, n: int) -> list[KVBlock]:
        """The next `n` blocks `get_new_blocks` would hand out, in that order (not taken):
        per block, its live free-queue entry (BlockPool's docstring)."""
        out: list[KVBlock] = []
        if n <= 0:
            return out
        seen: dict[KVBlock, int] = {}
        for block in self._queue:
            if block.ref_cnt:
                continue
            k = seen[block] = seen.get(block, 0) + 1
            if k == block.queued:  # its live entry
                out.append(block)
                if len(out) == n:
                    break
        return out

    def unget(self, blocks: Sequence[KVBlock], hashes: Sequence[Any]) -> None:
        """Undoes `get_new_blocks` for blocks nothing wrote: they go back to the head of
        the free queue in order, each holding again the cached hash it was taken with
        (its KV is untouched), as if never taken. No event: the decode window publishes
        the evictions it keeps."""
        if any(b.queued for b in blocks):  # stale entries later on: drop them first
            self._compact()
        for block, h in zip(reversed(blocks), reversed(hashes), strict=True):
            if block.ref_cnt != 1 or block.block_hash is not None:
                raise RuntimeError(f"unget of block {block.block_id}: in use or cached")
            block.ref_cnt = 0
            block.queued = 1
            self._queue.appendleft(block)
            self._num_free += 1
            if h is not None:
                if h in self._cached:
                    raise RuntimeError(f"unget of block {block.block_id}: hash cached again")
                block.block_hash = h
                self._cached[h] = block
