"""Blocks pinned for peers (peer fetch, the holder's side): the leading run of a
prompt's blocks this engine holds, each with a reference taken so it is neither evicted
nor reused until unpinned. Device prefix-cache hits first, then what the offload tiers
hold, loaded into fresh (and then cached) blocks.

One mechanism for the engine (LLMEngine.pin_cached / unpin) and the simulator's workers
(sim/worker.py), which pin over simulated tiers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.block_hash import BlockHash
from engine.block_pool import BlockPool, KVBlock
from engine.offload import KVOffload


class Pins:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.counts: dict[int, int] = {}  # block id -> references pins hold

    def pin(self, hashes: Sequence[BlockHash], store: KVOffload | None = None,
            kv_cache: Any = None) -> list[KVBlock]:
        """The blocks holding the leading run of `hashes` here, pinned; `store` (the
        offload tiers) fills what the device misses into `kv_cache`'s new blocks."""
        pool = self.pool
        blocks = []
        for h in hashes:
            b = pool.get_cached_block(h)
            if b is None:
                break
            blocks.append(b)
        pool.touch(blocks)
        rest = list(hashes[len(blocks):])
        if rest and store is not None:
            n = store.lookup(rest)
            new = pool.get_new_blocks(n) if n else None
            if new:
                got = store.load(rest[:n], [b.block_id for b in new], kv_cache)
                pool.free(new[got:])
                pool.cache_full_blocks(new[:got], rest[:got],
                                       blocks[-1].block_hash if blocks else None)
                blocks += new[:got]
        for b in blocks:
            self.counts[b.block_id] = self.counts.get(b.block_id, 0) + 1
        return blocks

    def unpin(self, blocks: Sequence[KVBlock]) -> None:
        """Drops the references `pin` took."""
        for b in blocks:
            left = self.counts[b.block_id] - 1
            if left:
                self.counts[b.block_id] = left
            else:
                del self.counts[b.block_id]
        self.pool.free(blocks)
