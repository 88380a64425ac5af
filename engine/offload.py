"""The engine's hook for an external KV cache (host DRAM, disk, peers...).

vLLM's KV-connector split, in one process: the scheduler side decides (how many of a
request's leading blocks the external cache holds, which freshly allocated blocks they
load into), the worker side moves bytes (loads before the forward that needs them;
saves of newly cached blocks, asynchronously). The bridge is `OffloadConnector`'s
per-step list of `KVLoad`s.

The engine imports nothing of ours: the implementation (`kvtransfer.tiers.TieredCache`)
is passed in by whoever builds the engine. All `KVOffload` calls come from the engine
thread; the implementation may copy on its own threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from engine.block_hash import BlockHash
from engine.block_pool import BlockPool, KVBlock

if TYPE_CHECKING:
    import torch

    from engine.request import Request


class KVOffload(Protocol):
    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` the external cache can load now."""
        ...

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int],
             kv_cache: torch.Tensor) -> int:
        """Copies the leading run of `hashes` it holds into `kv_cache[block_ids]`
        (synchronously: done when it returns); returns how many blocks were loaded."""
        ...

    def save(self, hashes: Sequence[BlockHash], block_ids: Sequence[int],
             kv_cache: torch.Tensor) -> list[int]:
        """Starts copying newly cached device blocks out. Returns the block ids it will
        read later: the engine keeps those alive until `take_saved` returns them."""
        ...

    def take_saved(self, timeout: float = 0.0) -> list[int]:
        """Block ids whose copy finished since the last call (waits up to `timeout`
        seconds for at least one while saves are pending)."""
        ...


@dataclass(slots=True)
class KVLoad:
    """Blocks `block_ids` of `request` are to be filled from the external cache."""

    request: Request
    hashes: list[BlockHash]
    block_ids: list[int]


@dataclass(slots=True)
class OffloadConnector:
    """Engine-side bookkeeping around a KVOffload: planned loads of this step, and the
    device blocks held (one reference each) while their copy out is running."""

    offload: KVOffload
    block_size: int
    loads: list[KVLoad] = field(default_factory=list)
    saving: dict[int, KVBlock] = field(default_factory=dict)  # block_id -> held block
    loaded_blocks: int = 0  # cumulative, for stats

    # -- scheduler side ----------------------------------------------------------------
    def match(self, request: Request, num_device_blocks: int) -> int:
        """Blocks after the device hit that the external cache holds (one token always
        stays to compute: its logits are sampled)."""
        if request.wants_prompt_logprobs:  # its prompt must run through the model
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.update_block_hashes(self.block_size)[num_device_blocks:max_blocks]
        return self.offload.lookup(hashes) if hashes else 0

    def plan_load(self, request: Request, block_ids: Sequence[int], first: int,
                  num: int) -> None:
        hashes = request.block_hashes[first:first + num]
        self.loads.append(KVLoad(request, list(hashes), list(block_ids[first:first + num])))

    # -- worker side -------------------------------------------------------------------
    def run_loads(self, kv_cache: torch.Tensor) -> list[tuple[KVLoad, int]]:
        """Runs this step's loads; returns the short ones with the blocks that landed."""
        short = []
        loads, self.loads = self.loads, []
        for ld in loads:
            got = self.offload.load(ld.hashes, ld.block_ids, kv_cache)
            self.loaded_blocks += got
            if got < len(ld.hashes):
                short.append((ld, got))
        return short

    def save_new(self, pool: BlockPool, kv_cache: torch.Tensor) -> None:
        """Hands blocks the pool newly cached to the offload; holds those it copies."""
        new = pool.take_new_cached()
        if not new:
            return
        hashes = [b.block_hash for b in new if b.block_hash is not None]
        kept = set(self.offload.save(hashes, [b.block_id for b in new], kv_cache))
        held = [b for b in new if b.block_id in kept]
        pool.touch(held)
        self.saving.update((b.block_id, b) for b in held)

    def reap(self, pool: BlockPool, timeout: float = 0.0) -> None:
        """Drops the references of blocks whose copy finished."""
        done = self.offload.take_saved(timeout) if self.saving else []
        pool.free(self.saving.pop(b) for b in done)


class RankView:
    """A tensor-parallel engine's pool as the tiers see it (rank 0 maps every rank's
    cache: CPU): `index_select(0, ids)` returns the blocks with every KV head, read
    straight from the ranks' caches (a head replicated on several ranks from one);
    `scatter` writes full-head blocks into each rank's heads of the blocks. What a
    KVOffload reads on its own thread: the device, and blocks by id."""

    def __init__(self, caches: list[torch.Tensor], heads: list[tuple[int, int]]) -> None:
        self.caches = caches
        self.heads = heads  # [first, end) of the model's KV heads, per rank
        self.owners: list[int] = []  # one rank per run of heads, in head order
        covered = 0
        for r, (first, end) in enumerate(heads):
            if first >= covered:
                self.owners.append(r)
                covered = end
        self.device = caches[0].device
        self.is_cuda = caches[0].is_cuda

    def full_shape(self, num_blocks: int) -> tuple[int, ...]:
        shape = list(self.caches[0].shape)
        shape[0], shape[4] = num_blocks, self.heads[-1][1]
        return tuple(shape)

    def index_select(self, dim: int, ids: torch.Tensor) -> torch.Tensor:
        import torch

        if dim != 0:
            raise ValueError("a rank view selects blocks (dim 0) only")
        return torch.cat([self.caches[r].index_select(0, ids) for r in self.owners], dim=4)

    def scatter(self, block_ids: Sequence[int], full: torch.Tensor) -> None:
        for cache, (first, end) in zip(self.caches, self.heads, strict=True):
            cache[list(block_ids)] = full[:, :, :, :, first:end]


class RankViewOffload:
    """A KVOffload for a tensor-parallel engine whose rank 0 maps every rank's cache
    (CPU): the tiers keep full-head blocks (the same as a TP 1 worker's), saved from
    each rank's cache and loaded into each rank's cache directly (`RankView`), with
    no copy of the pool through rank 0. A block a save still reads is held by the
    engine (`OffloadConnector.saving`), as on one rank."""

    def __init__(self, inner: KVOffload, view: RankView) -> None:
        self.inner = inner
        self.view = view

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        return self.inner.lookup(hashes)

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int],
             kv_cache: torch.Tensor) -> int:
        import torch

        full = torch.empty(self.view.full_shape(len(block_ids)), dtype=kv_cache.dtype,
                           device=kv_cache.device)
        got = self.inner.load(hashes, range(len(block_ids)), full)
        if got:
            self.view.scatter(block_ids[:got], full[:got])
        return got

    def save(self, hashes: Sequence[BlockHash], block_ids: Sequence[int],
             kv_cache: torch.Tensor) -> list[int]:
        # the tiers read blocks by id on their own thread: from the ranks' caches
        return self.inner.save(hashes, block_ids, cast("torch.Tensor", self.view))

    def take_saved(self, timeout: float = 0.0) -> list[int]:
        return self.inner.take_saved(timeout)

    def __getattr__(self, name: str) -> Any:  # the rest (stats, close) is the tiers'
        return getattr(self.inner, name)


class RankGatheredOffload:
    """A KVOffload for a tensor-parallel engine, whose ranks each hold their KV heads,
    where rank 0 cannot address the ranks' caches (CUDA):
    the tiers keep full-head blocks (the same as a TP 1 worker's) and copy them through
    rank 0's staging copy of the pool: saves gather the blocks from every rank into it
    first; loads land in it and are then scattered to the ranks. A block a save still
    reads is held by the engine (`OffloadConnector.saving`), so no load or transfer
    rewrites its staging copy meanwhile."""

    def __init__(self, inner: KVOffload, runner: Any) -> None:
        self.inner = inner
        self.runner = runner  # engine.model_runner.ModelRunner, rank 0

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        return self.inner.lookup(hashes)

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int],
             kv_cache: torch.Tensor) -> int:
        staging = self.runner.staging()
        got = self.inner.load(hashes, block_ids, staging)
        self.runner.scatter_blocks(list(block_ids[:got]), staging)
        return got

    def save(self, hashes: Sequence[BlockHash], block_ids: Sequence[int],
             kv_cache: torch.Tensor) -> list[int]:
        staging = self.runner.staging()
        self.runner.gather_blocks(list(block_ids), staging)
        return self.inner.save(hashes, block_ids, staging)

    def take_saved(self, timeout: float = 0.0) -> list[int]:
        return self.inner.take_saved(timeout)

    def __getattr__(self, name: str) -> Any:  # the rest (stats, close) is the tiers'
        return getattr(self.inner, name)
