"""The LMCache tier (LMCache 0.5.x) through its CPU, local-disk and Redis-remote
backends: bit-exact restore of our block-major blocks keyed by our block hashes.
LMCache writes asynchronously (no flush), so tests poll `contains` with a deadline."""

import os
import time

import pytest
import torch

from kvtransfer.tiers import LMCacheTierConfig
from kvtransfer.tiers.lmcache_tier import IMPORT_ERROR
from tests.unit.kvtransfer.test_tiers import LAYOUT, make_blocks

if IMPORT_ERROR is not None:
    pytest.skip(f"LMCache is not importable ({IMPORT_ERROR}); install with "
                "pip install 'splitserve[lmcache]' && pip install --no-deps "
                "'lmcache>=0.5,<0.6'", allow_module_level=True)

from kvtransfer.tiers.lmcache_tier import LMCacheTier  # noqa: E402


def wait_contains(tier, hashes, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while (n := tier.contains(hashes)) < len(hashes) and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


def make_tier(name: str, close_timeout_s: float = 3.0, **overrides) -> LMCacheTier:
    base = {"local_cpu": False, "max_local_cpu_size": 0.05}
    base.update(overrides)
    return LMCacheTier(LAYOUT, LMCacheTierConfig(instance_id=name,
                                                 close_timeout_s=close_timeout_s,
                                                 overrides=tuple(base.items())))


@pytest.mark.parametrize("backend", ["cpu", "disk"])
def test_lmcache_tier_restores_blocks_bit_exact(backend, tmp_path):
    kw = {"local_cpu": True} if backend == "cpu" else \
        {"local_disk": str(tmp_path), "max_local_disk_size": 0.05}
    tier = make_tier(f"t-{backend}", **kw)
    try:
        hashes, data = make_blocks(4, seed=3)
        tier.put(hashes, list(data))
        assert wait_contains(tier, hashes) == 4
        assert tier.contains(hashes[1:]) == 3
        out = torch.zeros_like(data)
        assert tier.get(hashes, list(out)) == 4
        assert torch.equal(out, data)
        if backend == "disk":
            assert len(list(tmp_path.iterdir())) == 4  # one LMCache object per block
        assert tier.evict(hashes[2:3]) == 1
        assert tier.contains(hashes) == 2  # the leading run stops at the hole
    finally:
        tier.close()


def test_lmcache_tier_redis_remote_with_bounded_close():
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    # LMCache 0.5.6's destroy() never returns with a Redis remote: close abandons it
    # after close_timeout_s, so a short one keeps this test quick.
    tier = make_tier("t-redis", close_timeout_s=1.0, remote_url=server.url,
                     remote_serde="naive")
    try:
        hashes, data = make_blocks(3, seed=4)
        tier.put(hashes, list(data))
        assert wait_contains(tier, hashes) == 3
        out = torch.zeros_like(data)
        assert tier.get(hashes, list(out)) == 3
        assert torch.equal(out, data)
    finally:
        t0 = time.monotonic()
        tier.close()  # bounded by close_timeout_s, not by LMCache
        assert time.monotonic() - t0 < 3.0
        server.kill()


def test_lmcache_tier_leaves_the_environment_as_it_was(monkeypatch):
    """LMCache's metrics logger sets PROMETHEUS_MULTIPROC_DIR; children started after
    the tier (TP ranks, a worker's subprocesses) must not inherit it."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    tier = make_tier("t-env", local_cpu=True)
    try:
        assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    finally:
        tier.close()
