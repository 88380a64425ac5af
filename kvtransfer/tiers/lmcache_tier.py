"""LMCache-backed tier (optional extra `splitserve[lmcache]`, LMCache 0.5.x): an
LMCacheEngine with its own CPU / disk / Redis-remote backends, keyed by our block
hashes, fed by a pure-torch connector from our block-major layout.

Mapping: one LMCache chunk = one of our blocks (chunk_size = block_size); a chunk's
key is built from our 128-bit block hash (`LMCacheEngine.store(hashes=...)`), so
keys are the same on every node and process; LMCache's own token hashing is unused.
Its memory objects are `[2, num_layers, block_size, num_kv_heads * head_dim]`
(KV_2LTD); the connector permutes our `[num_layers, 2, block_size, heads, dim]`.

Known traps, handled here:
- Telemetry: LMCache reports usage unless `LMCACHE_TRACK_USAGE=false` (env read by
  LMCache itself). Our CLIs set it; constructing this tier with tracking on raises.
- Writes are asynchronous (disk and remote backends put in background threads) and
  there is no flush: `contains` may say "not yet" right after `put`.
- `LMCacheEngineBuilder.destroy()` can hang with a Redis remote: `close` runs it in a
  daemon thread and gives up after `close_timeout_s`.

Install: lmcache's metadata pins protobuf<7, numpy<=2.2.6 and CUDA wheels
(cupy-cuda13x, cuda-python), which conflict with ours; its CPU paths work without
them. So: `pip install 'splitserve[lmcache]'` (its runtime deps) and then
`pip install --no-deps 'lmcache>=0.5,<0.6'`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from engine.block_hash import BlockHash
from kvtransfer.layout import KVLayout
from kvtransfer.memory import torch_dtype
from kvtransfer.tiers.base import SpareFn, TierError
from kvtransfer.tiers.config import LMCacheTierConfig

log = logging.getLogger(__name__)

try:  # the optional extra
    from lmcache.usage_telemetry.identity import is_usage_tracking_enabled
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata
    IMPORT_ERROR: Exception | None = None
except Exception as e:  # ImportError, or a broken native extension
    IMPORT_ERROR = e
    GPUConnectorInterface = object


def hash_to_int(h: BlockHash) -> int:
    return int.from_bytes(h, "little")


class BlockMajorConnector(GPUConnectorInterface):  # type: ignore[misc,valid-type]
    """Copies between our blocks and LMCache memory objects. kwargs: `blocks`, the
    block tensors (one per chunk, in order; chunk i starts at token i * block_size)."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout

    def get_shape(self, num_tokens: int) -> torch.Size:
        lay = self.layout
        return torch.Size([2, lay.num_layers, num_tokens, lay.num_kv_heads * lay.head_dim])

    @staticmethod
    def to_obj_layout(block: torch.Tensor) -> torch.Tensor:
        """[L, 2, T, H, D] -> [2, L, T, H*D] (a copy is made by the caller's copy_)."""
        L, two, T, H, D = block.shape
        return block.permute(1, 0, 2, 3, 4).reshape(two, L, T, H * D)

    def from_obj(self, obj_tensor: torch.Tensor, block: torch.Tensor) -> None:
        L, two, T, H, D = block.shape
        block.copy_(obj_tensor.reshape(two, L, T, H, D).permute(1, 0, 2, 3, 4),
                    non_blocking=block.is_cuda)

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(self, memory_objs: Any, starts: list[int], ends: list[int],
                         **kwargs: Any) -> None:
        blocks = kwargs["blocks"]
        for obj, start in zip(memory_objs, starts, strict=True):
            obj.tensor.copy_(self.to_obj_layout(blocks[start // self.layout.block_size]))

    def batched_to_gpu(self, memory_objs: Any = None, starts: list[int] | None = None,
                       ends: list[int] | None = None, **kwargs: Any) -> None:
        blocks = kwargs["blocks"]
        for obj, start in zip(memory_objs or [], starts or [], strict=True):
            self.from_obj(obj.tensor, blocks[start // self.layout.block_size])


class LMCacheTier:
    name = "lmcache"
    capacity = 0  # LMCache bounds and evicts by itself (max_local_cpu_size, ...)

    def __init__(self, layout: KVLayout, config: LMCacheTierConfig) -> None:
        if IMPORT_ERROR is not None:
            raise TierError(f"the lmcache tier needs LMCache 0.5.x (pip install "
                            f"'splitserve[lmcache]'): {IMPORT_ERROR}")
        if is_usage_tracking_enabled():
            raise TierError("LMCache usage telemetry is on: set LMCACHE_TRACK_USAGE=false "
                            "(the splitserve CLI does)")
        if layout.num_parts != 2:
            raise TierError(f"the lmcache tier stores K/V layouts only, not {layout.name!r} "
                            "(use the host and disk tiers for MLA latent blocks)")
        self.layout = layout
        self.config = config
        bs = layout.block_size
        lmc_cfg = LMCacheEngineConfig.from_file(config.config_file) if config.config_file \
            else LMCacheEngineConfig.from_defaults(local_cpu=True, max_local_cpu_size=1.0)
        for key, value in {**config.as_dict(), "chunk_size": bs, "save_unfull_chunk": False,
                           "use_layerwise": False, "enable_async_loading": False,
                           "py_enable_gc": True}.items():
            setattr(lmc_cfg, key, value)
        lmc_cfg.validate()
        fp = hashlib.blake2b(layout.to_json().encode(), digest_size=8).hexdigest()
        self._meta = LMCacheMetadata(
            model_name=f"splitserve-{fp}", world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=torch_dtype(layout),
            kv_shape=(layout.num_layers, 2, bs, layout.num_kv_heads, layout.head_dim),
            chunk_size=bs, role="worker")
        self._connector = BlockMajorConnector(layout)
        self._remote = bool(getattr(lmc_cfg, "remote_url", None))
        # Unique per tier: an abandoned (hung) destroy leaves its id registered.
        self._instance = f"{config.instance_id}-{uuid.uuid4().hex[:8]}"
        # LMCache's metrics logger sets PROMETHEUS_MULTIPROC_DIR when it is unset. This
        # process's metrics chose their mode at import, but every process started later
        # would inherit it and write pid-named files in one shared directory (processes in
        # PID namespaces all have pid 1): put the environment back.
        multiproc_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        try:
            self.engine = LMCacheEngineBuilder.get_or_create(
                self._instance, lmc_cfg, self._meta, self._connector,
                lambda t, r: None, lambda o, r: o)
            self.engine.post_init()
        finally:
            if multiproc_dir is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self._held = 0  # blocks put and not evicted by us (LMCache may drop more)

    def _offsets(self, n: int) -> list[int]:
        return [self.layout.block_size] * n

    def _keys(self, hashes: Sequence[BlockHash]) -> list[Any]:
        db = self.engine.token_database
        return [key for _, _, key in db.process_tokens(
            hashes=[hash_to_int(h) for h in hashes], offsets=self._offsets(len(hashes)))]

    def __len__(self) -> int:
        return self._held

    def contains(self, hashes: Sequence[BlockHash]) -> int:
        if not hashes:
            return 0
        tokens = self.engine.lookup(hashes=[hash_to_int(h) for h in hashes],
                                    offsets=self._offsets(len(hashes)))
        return int(tokens) // self.layout.block_size

    def get(self, hashes: Sequence[BlockHash], dst: Sequence[torch.Tensor]) -> int:
        keys = self._keys(hashes[:len(dst)])
        sm = self.engine.storage_manager
        mapping = sm.get_block_mapping([(k, i, i + 1) for i, k in enumerate(keys)])
        objs: dict[int, Any] = {}
        for location, infos in mapping.items():
            got = sm.batched_get(keys=[k for k, _, _ in infos], location=location)
            objs.update((i, o) for (_, i, _), o in zip(infos, got, strict=True))
        n = 0
        try:
            while n in objs and objs[n] is not None:
                self._connector.from_obj(objs[n].tensor, dst[n])
                n += 1
        finally:
            for o in objs.values():
                if o is not None:
                    o.ref_count_down()
        return n

    def put(self, hashes: Sequence[BlockHash], src: Sequence[torch.Tensor],
            spare: SpareFn | None = None) -> list[BlockHash]:
        if not hashes:
            return []
        n = len(hashes)
        self.engine.store(hashes=[hash_to_int(h) for h in hashes], offsets=self._offsets(n),
                          slot_mapping=list(range(n * self.layout.block_size)),
                          blocks=list(src))
        self._held += n
        return []  # LMCache's own evictions are not reported to us

    def victims(self, n: int, spare: SpareFn | None = None) -> list[BlockHash]:
        return []  # LMCache picks its own victims

    def evict(self, hashes: Sequence[BlockHash]) -> int:
        sm = self.engine.storage_manager
        removed = sum(1 for k in self._keys(hashes) if sm.remove(k))
        self._held = max(0, self._held - removed)
        return removed

    def hashes(self) -> list[BlockHash]:
        return []  # LMCache cannot list its keys; the index learns them from `put`

    def check_integrity(self) -> None:
        assert self.engine.storage_manager is not None, "LMCache engine not initialized"

    def close(self) -> None:
        """Destroys the LMCache engine, bounded by close_timeout_s.

        LMCache 0.5.6 deadlocks closing a Redis remote: RedisConnector.close runs on the
        storage manager's event loop and blocks that loop waiting for a coroutine it
        scheduled on itself; the loop's thread is not a daemon, so the process could
        never exit. With a remote we therefore stop that loop first (its thread ends),
        then run destroy() in a daemon thread and abandon it if it does not return.
        """
        sm = self.engine.storage_manager
        if self._remote and sm is not None and sm.loop.is_running():
            sm.loop.call_soon_threadsafe(sm.loop.stop)
            sm.thread.join(self.config.close_timeout_s)
        t = threading.Thread(target=LMCacheEngineBuilder.destroy, args=(self._instance,),
                             daemon=True, name="lmcache-destroy")
        t.start()
        t.join(self.config.close_timeout_s)
        if t.is_alive():
            log.warning("LMCache destroy() did not finish in %.1fs; abandoned",
                        self.config.close_timeout_s)
