"""How a worker process opens its offload tiers (worker/server.py calls this)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtransfer.tiers.config import TierConfig

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from engine.config import EngineConfig
    from kvtransfer.tiers.manager import TieredCache
    from kvtransfer.tiers.sparing import SoleCopyView, SparingConfig


def open_tiers(config: TierConfig | None, engine_config: EngineConfig,
               registry: CollectorRegistry | None = None) -> TieredCache | None:
    """The worker's TieredCache (None when no tier is enabled), its figures exported
    to `registry`. The caller passes it to the engine and closes it after the engine
    has shut down; `attach_publisher` wires the block index once one runs."""
    if config is None or not config.enabled:
        return None
    from kvtransfer.tiers.manager import TieredCache, engine_layout
    from kvtransfer.tiers.metrics import TierCollector

    tiers = TieredCache(config, engine_layout(engine_config))
    if registry is not None:
        registry.register(TierCollector(tiers.stats))
    return tiers


def attach_index(tiers: TieredCache, publisher: Any,
                 sparing: SparingConfig | None = None) -> SoleCopyView:
    """Wires the worker's block-index publisher (worker/kv_events.py KVEventPublisher) into
    `tiers`: their stores, evictions and resyncs go to the index, and eviction spares
    blocks the index says no other node holds (a view refreshed on the running loop).
    The caller `close()`s the returned view before closing the publisher."""
    from kvtransfer.tiers.sparing import start_sole_copy_sparing

    tiers.attach_publisher(publisher)
    return start_sole_copy_sparing(tiers, publisher.index, publisher.node, sparing)
