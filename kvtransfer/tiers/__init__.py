"""The multi-tier KV offload cache: host DRAM, local disk, LMCache (docs/architecture.md,
"Tiers and the index"). `CacheTier` (base.py) is the protocol, `TieredCache`
(manager.py) the manager the engine's offload hook talks to, `TierConfig` (config.py)
the config, `SoleCopyView` (sparing.py) the eviction predicate that spares blocks the
Redis index says no other node holds.

Importing this package is cheap; torch loads with the manager and the tiers.
"""

from __future__ import annotations

from kvtransfer.tiers.base import CacheTier, SpareFn, TierError
from kvtransfer.tiers.config import LMCacheTierConfig, TierConfig

__all__ = ["CacheTier", "LMCacheTierConfig", "SpareFn", "TierConfig", "TierError"]
