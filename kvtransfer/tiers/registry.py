"""Tiers by name, built from a TierConfig. Heavy backends (LMCache) load lazily."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from kvtransfer.layout import KVLayout
from kvtransfer.tiers.base import CacheTier
from kvtransfer.tiers.config import TierConfig

TierFactory = Callable[[TierConfig, KVLayout], CacheTier]


def _host(config: TierConfig, layout: KVLayout) -> CacheTier:
    from kvtransfer.tiers.host import HostTier

    return HostTier(layout, config.host_blocks, config.pin_memory, config.spare_scan)


def _disk(config: TierConfig, layout: KVLayout) -> CacheTier:
    from kvtransfer.tiers.disk import DiskTier

    assert config.disk_dir is not None  # TierConfig checked
    return DiskTier(layout, config.disk_dir, config.disk_blocks, config.disk_direct_io,
                    config.spare_scan)


def _lmcache(config: TierConfig, layout: KVLayout) -> CacheTier:
    module = importlib.import_module("kvtransfer.tiers.lmcache_tier")
    assert config.lmcache is not None
    tier: CacheTier = module.LMCacheTier(layout, config.lmcache)
    return tier


TIERS: dict[str, TierFactory] = {"host": _host, "disk": _disk, "lmcache": _lmcache}


def register_tier(name: str, factory: TierFactory) -> None:
    """Adds a tier implementation (chosen by name from config)."""
    TIERS[name] = factory


def make_tier(name: str, config: TierConfig, layout: KVLayout) -> CacheTier:
    if name not in TIERS:
        raise ValueError(f"unknown cache tier {name!r}; known: {sorted(TIERS)}")
    return TIERS[name](config, layout)
