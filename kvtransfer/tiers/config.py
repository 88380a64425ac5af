"""Configuration of the offload tiers (one frozen dataclass, built by the CLI)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TIER_ORDER = ("host", "disk", "lmcache")


@dataclass(frozen=True, slots=True)
class LMCacheTierConfig:
    """An LMCache (0.5.x) engine used as a tier. `config_file`: an LMCache YAML config
    (its local_cpu / local_disk / remote_url backends); `overrides` are applied on top.
    `chunk_size` is forced to the engine's block size (one LMCache chunk = one block).
    `close_timeout_s` bounds LMCacheEngineBuilder.destroy(), which can hang with a Redis
    remote."""

    config_file: str | None = None
    overrides: tuple[tuple[str, Any], ...] = ()
    instance_id: str = "splitserve"
    close_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.close_timeout_s <= 0:
            raise ValueError("lmcache close_timeout_s must be positive")
        if not self.instance_id:
            raise ValueError("lmcache instance_id must be non-empty")

    def as_dict(self) -> dict[str, Any]:
        return dict(self.overrides)


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Which tiers a node keeps, best first: host DRAM, local disk, LMCache.

    A tier is enabled by giving it capacity (host_blocks, disk_dir + disk_blocks) or a
    config (lmcache). Saves land in the first enabled tier; each tier's LRU victims are
    demoted to the next one; the last tier's victims are dropped.
    """

    host_blocks: int = 0
    disk_dir: str | None = None
    disk_blocks: int = 0
    disk_direct_io: bool | None = None  # None: O_DIRECT where the filesystem takes it
    lmcache: LMCacheTierConfig | None = None
    pin_memory: bool | None = None  # None: pinned when CUDA is available
    save_queue_blocks: int = 4096  # blocks waiting for their host copy, at most
    spare_scan: int = 64  # LRU candidates examined to spare sole copies

    def __post_init__(self) -> None:
        if self.host_blocks < 0 or self.disk_blocks < 0:
            raise ValueError("host_blocks and disk_blocks must be >= 0")
        if (self.disk_dir is None) != (self.disk_blocks == 0):
            raise ValueError("the disk tier needs both disk_dir and disk_blocks > 0")
        if self.save_queue_blocks <= 0 or self.spare_scan <= 0:
            raise ValueError("save_queue_blocks and spare_scan must be positive")

    @property
    def tiers(self) -> tuple[str, ...]:
        """Enabled tier names, best first."""
        on = {"host": self.host_blocks > 0, "disk": self.disk_blocks > 0,
              "lmcache": self.lmcache is not None}
        return tuple(t for t in TIER_ORDER if on[t])

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)


def tier_config_from_args(args: Any) -> TierConfig:
    """TierConfig from the engine CLI flags (engine/cli.py). CLI-only: with an LMCache
    tier it also turns LMCache's usage telemetry off in this process's environment
    (LMCache reads LMCACHE_TRACK_USAGE itself) unless the user set it."""
    lmcache = None
    if getattr(args, "lmcache_config", None):
        import os

        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        lmcache = LMCacheTierConfig(config_file=args.lmcache_config)
    direct = {"auto": None, "on": True, "off": False}[getattr(args, "disk_direct_io", "auto")]
    return TierConfig(host_blocks=getattr(args, "host_cache_blocks", 0),
                      disk_dir=getattr(args, "disk_cache_dir", None),
                      disk_blocks=getattr(args, "disk_cache_blocks", 0),
                      disk_direct_io=direct, lmcache=lmcache)
