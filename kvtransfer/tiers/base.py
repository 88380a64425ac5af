"""The face of the offload tiers: what `TieredCache` (and anyone else) programs against.

A tier stores whole KV blocks keyed by their block hash (engine/block_hash.py). Blocks
form prefix chains, so lookups are about leading runs: `contains` answers how many of
the leading hashes are present, `get` copies that leading run out. Every call is
batched. A tier owns its storage (pinned host memory, files, an LMCache engine); the
tensors passed to `get`/`put` stay the caller's.

One block in transit is a tensor of the layout's block shape
`[num_layers, parts, block_size, num_kv_heads, head_dim]` (`KVLayout.tensor_shape`: a
view of one block of the engine's block-major cache, or a host copy of one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from engine.block_hash import BlockHash
from kvtransfer.errors import KVTransferError

if TYPE_CHECKING:
    import torch

# True for a block that must be spared by eviction when another can go (e.g. the
# index says this node holds the cluster's only copy). See TieredCache.
SpareFn = Callable[[BlockHash], bool]


class BlockHolders(Protocol):
    """What sole-copy sparing (sparing.py) asks the block index (kvtransfer.index's
    RedisBlockIndex): which nodes hold each block; None when the index cannot say."""

    async def holders(self, hashes: Sequence[BlockHash]
                      ) -> dict[BlockHash, frozenset[str]] | None: ...


class TierError(KVTransferError):
    """A tier failed to read or write (I/O error, corrupt file, backend failure)."""

    kind = "tier"


class CacheTier(Protocol):
    """One storage level of the offload cache. Methods are called under the owning
    TieredCache's lock (one caller at a time); a tier needs no locking of its own."""

    name: str
    capacity: int  # blocks; 0 = bounded by the backend itself (LMCache)

    def contains(self, hashes: Sequence[BlockHash]) -> int:
        """Length of the leading run of `hashes` this tier holds (no LRU change)."""
        ...

    def get(self, hashes: Sequence[BlockHash], dst: Sequence[torch.Tensor]) -> int:
        """Copies the leading run of present blocks into `dst` (same order); returns
        how many were copied. Marks them recently used."""
        ...

    def put(self, hashes: Sequence[BlockHash], src: Sequence[torch.Tensor],
            spare: SpareFn | None = None) -> list[BlockHash]:
        """Stores copies of `src` under `hashes` (present ones are only touched); a full
        tier evicts LRU blocks first, sparing `spare`d ones while others can go.
        Returns the hashes it evicted (gone from this tier)."""
        ...

    def victims(self, n: int, spare: SpareFn | None = None) -> list[BlockHash]:
        """The `n` blocks eviction would take next (LRU, spared ones last); no change."""
        ...

    def evict(self, hashes: Sequence[BlockHash]) -> int:
        """Drops these blocks; returns how many were present."""
        ...

    def __len__(self) -> int: ...

    def hashes(self) -> list[BlockHash]:
        """Every block held, least recently used first (for index rebuilds)."""
        ...

    def check_integrity(self) -> None:
        """Raises AssertionError if the tier's bookkeeping is inconsistent."""
        ...

    def close(self) -> None:
        """Releases resources (bounded in time); the tier is unusable afterwards."""
        ...
