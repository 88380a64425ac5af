"""Rank 0's full-head staging copy of the KV pool: the KV hand-off and the offload tiers
under tensor parallelism where rank 0 cannot address the ranks' caches (CUDA).

Each rank holds its KV heads of every block. Rank 0 keeps `staging`, a full-head tensor
with the pool's block ids, that the transports register instead of the cache: blocks
are gathered into it before they are sent (or saved to a tier) and scattered from it to
the ranks after they land (or load); the wire carries full-head blocks, as from TP 1.
`ModelRunner` takes these methods from `KVStaging`; ranks 1..N-1 run `read_blocks` /
`write_blocks` on rank 0's "read" / "write" commands (engine/tp_ranks.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.kv_sizing import kv_cache_shape

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.distributed import TPGroup


class KVStaging:
    """The staging side of ModelRunner (the attributes below are the runner's)."""

    tp: TPGroup | None
    model_cfg: ModelConfig
    block_size: int
    num_blocks: int
    device: torch.device
    kv_cache: torch.Tensor
    kv_dtype: torch.dtype
    kv_staging: torch.Tensor | None
    staged_blocks: int

    def _tell(self, command: tuple) -> None:
        raise NotImplementedError

    def full_kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        return kv_cache_shape(self.model_cfg, num_blocks, self.block_size)

    def staging(self) -> torch.Tensor:
        """Rank 0's full-head staging copy (allocated on first use, unless the worker
        set `kv_staging` to one it allocated: shm's shared segment)."""
        if self.kv_staging is None:
            self.kv_staging = torch.zeros(self.full_kv_shape(self.num_blocks),
                                          dtype=self.kv_dtype, device=self.device)
        return self.kv_staging

    @torch.inference_mode()
    def gather_blocks(self, ids: list[int], staging: torch.Tensor) -> None:
        """Rank 0: blocks `ids` with every KV head, from every rank, into staging[ids]."""
        if ids:
            self.staged_blocks += len(ids)
            self._tell(("read", list(ids)))
            staging[ids] = self.read_blocks(ids).to(staging.device)
            if self.device.type == "cuda":  # a transport reads staging from another stream
                torch.cuda.current_stream(self.device).synchronize()

    @torch.inference_mode()
    def scatter_blocks(self, ids: list[int], staging: torch.Tensor) -> None:
        """Rank 0: staging[ids] (every KV head) into each rank's heads of blocks `ids`."""
        if ids:
            self.staged_blocks += len(ids)
            self._tell(("write", list(ids)))
            self.write_blocks(ids, staging[ids].to(self.device))

    def read_blocks(self, ids: list[int]) -> torch.Tensor:
        """Every rank (rank 0's "read" command): this rank's heads of blocks `ids`,
        all-gathered; the full-head blocks (replicated heads taken once)."""
        from engine.models.parallel_layers import kv_head_range

        assert self.tp is not None
        # as bytes: the collectives and cat take any 1-byte cache (FP8) that way
        local = _as_bytes(self.kv_cache[torch.tensor(ids, device=self.device)])
        parts = self.tp.all_gather(local.unsqueeze(0), dim=0)
        owners: list[int] = []  # for each rank in head order, one holding new heads
        covered = 0
        for r in range(self.tp.size):
            first, end = kv_head_range(self.model_cfg, r, self.tp.size)
            if first >= covered:
                owners.append(r)
                covered = end
        return torch.cat([parts[r] for r in owners], dim=4).view(self.kv_cache.dtype)

    def write_blocks(self, ids: list[int], full: torch.Tensor | None = None) -> None:
        """Every rank (rank 0's "write" command): blocks `ids` with every head, broadcast
        from rank 0 (`full` there); this rank keeps its heads."""
        from engine.models.parallel_layers import kv_head_range

        assert self.tp is not None
        if full is None:
            full = torch.empty(self.full_kv_shape(len(ids)), dtype=self.kv_cache.dtype,
                               device=self.device)
        self.tp.broadcast(_as_bytes(full))
        first, end = kv_head_range(self.model_cfg, self.tp.rank, self.tp.size)
        self.kv_cache[torch.tensor(ids, device=self.device)] = full[:, :, :, :, first:end]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as uint8 (the same bytes), others as they are."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
