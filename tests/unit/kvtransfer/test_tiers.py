"""The offload tiers without an engine: bit-exact round trips, leading-run lookups, LRU
with sole-copy sparing, the disk tier's restart / orphan / corruption handling and
O_DIRECT fallback, and TieredCache demotion with index events."""

import os
import tempfile

import pytest
import torch

from engine.block_hash import hash_blocks
from kvtransfer.layout import KVLayout
from kvtransfer.tiers import TierConfig, TierError
from kvtransfer.tiers.disk import DiskTier, probe_direct_io
from kvtransfer.tiers.host import HostTier
from kvtransfer.tiers.manager import TieredCache

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")


def make_blocks(n: int, seed: int = 0, layout: KVLayout = LAYOUT):
    """n chained block hashes and random KV blocks for them."""
    g = torch.Generator().manual_seed(seed)
    hashes = hash_blocks(list(range(seed * 1000, seed * 1000 + n * 4)), 4, b"test")
    data = torch.randn(layout.tensor_shape(n), generator=g)
    return hashes, data


def roundtrip(tier, hashes, data) -> torch.Tensor:
    out = torch.zeros_like(data)
    assert tier.get(hashes, list(out)) == len(hashes)
    return out


def test_host_tier_bit_exact_leading_run_and_lru():
    tier = HostTier(LAYOUT, capacity=4, pin_memory=False)
    hashes, data = make_blocks(6)
    assert tier.put(hashes[:4], list(data[:4])) == []
    assert torch.equal(roundtrip(tier, hashes[:4], data[:4]), data[:4])
    assert tier.contains(hashes) == 4 and tier.contains(hashes[1:]) == 3
    assert tier.contains([hashes[5]] + hashes[:4]) == 0  # leading run only
    tier.get(hashes[:1], [torch.empty_like(data[0])])  # block 0 is now most recent
    assert tier.put(hashes[4:6], list(data[4:6])) == [hashes[1], hashes[2]]  # LRU goes
    assert tier.contains([hashes[0], hashes[3], hashes[4], hashes[5]]) == 4
    tier.check_integrity()


def test_eviction_spares_sole_copies_while_others_can_go():
    tier = HostTier(LAYOUT, capacity=3, pin_memory=False)
    hashes, data = make_blocks(5)
    tier.put(hashes[:3], list(data[:3]))
    sole = {hashes[0], hashes[1]}  # the index says no other node holds these
    assert tier.put(hashes[3:4], list(data[3:4]), spare=sole.__contains__) == [hashes[2]]
    # Only spared blocks left besides the newest: LRU among them, not a failure.
    assert tier.victims(2, spare=lambda h: h != hashes[3]) == [hashes[3], hashes[0]]
    tier.check_integrity()


def test_disk_tier_bit_exact_restart_orphans_and_corruption(tmp_path):
    d = str(tmp_path / "kv")
    hashes, data = make_blocks(5)
    tier = DiskTier(LAYOUT, d, capacity=8)
    assert tier.direct_io == probe_direct_io(d)
    tier.put(hashes, list(data))
    assert torch.equal(roundtrip(tier, hashes, data), data)
    tier.check_integrity()
    with pytest.raises(TierError, match="in use"):
        DiskTier(LAYOUT, d, capacity=8)  # one worker per directory
    tier.close()
    # Leftovers of a crash: a partial write, a truncated block, junk, another layout.
    open(os.path.join(d, hashes[0].hex() + ".kvb.tmp"), "wb").write(b"x" * 100)
    open(os.path.join(d, "ff" * 16 + ".kvb"), "wb").write(b"short")
    open(os.path.join(d, "notes.txt"), "w").write("junk")
    other = KVLayout(2, 4, 8, 4, "float32")  # same block size in bytes, other layout
    foreign = DiskTier(other, str(tmp_path / "other"), capacity=2)
    foreign.put([b"\x01" * 16], [torch.zeros(other.tensor_shape(1)[1:])])
    foreign.close()
    os.rename(os.path.join(tmp_path, "other", "01" * 16 + ".kvb"),
              os.path.join(d, "01" * 16 + ".kvb"))
    restarted = DiskTier(LAYOUT, d, capacity=8)
    assert restarted.num_orphans_removed == 4
    assert restarted.contains(hashes) == 5
    assert torch.equal(roundtrip(restarted, hashes, data), data)
    restarted.check_integrity()
    # A flipped payload byte is caught by the checksum: a miss, and the file is gone.
    path = os.path.join(d, hashes[2].hex() + ".kvb")
    with open(path, "r+b") as f:
        f.seek(4096 + 10)
        b = f.read(1)
        f.seek(4096 + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    out = torch.zeros_like(data)
    assert restarted.get(hashes, list(out)) == 2
    assert restarted.contains(hashes) == 2 and not os.path.exists(path)
    restarted.check_integrity()
    restarted.close()


def test_disk_tier_buffered_io_writes_the_same_files(tmp_path):
    """Buffered I/O (the fallback where O_DIRECT is refused, e.g. older tmpfs) and
    O_DIRECT read each other's files."""
    hashes, data = make_blocks(2)
    tier = DiskTier(LAYOUT, str(tmp_path), capacity=2, direct_io=False)
    tier.put(hashes, list(data))
    tier.close()
    again = DiskTier(LAYOUT, str(tmp_path), capacity=2)  # auto: O_DIRECT on ext4/xfs
    assert again.num_orphans_removed == 0
    assert torch.equal(roundtrip(again, hashes, data), data)
    again.close()


def test_disk_tier_refuses_forced_o_direct_where_unsupported():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        if probe_direct_io(d):
            pytest.skip("this kernel's tmpfs accepts O_DIRECT (Linux >= 6.6)")
        with pytest.raises(TierError, match="O_DIRECT"):
            DiskTier(LAYOUT, d, capacity=2, direct_io=True)
        assert DiskTier(LAYOUT, d, capacity=2).direct_io is False


def test_tiered_cache_demotes_host_to_disk_and_publishes(tmp_path):
    events: list[tuple[str, tuple, tuple]] = []

    def publish(stored=(), removed=()):
        events.append(("pub", tuple(stored), tuple(removed)))

    cfg = TierConfig(host_blocks=2, disk_dir=str(tmp_path), disk_blocks=3)
    with TieredCache(cfg, LAYOUT, publish=publish) as tc:
        hashes, data = make_blocks(6)
        tc.put(hashes[:2], list(data[:2]))
        tc.put(hashes[2:4], list(data[2:4]))  # host full: blocks 0, 1 go to disk
        assert tc.stats().blocks == {"host": 2, "disk": 2}
        stored = [e for ev in events for e in ev[1]]
        removed = [e for ev in events for e in ev[2]]
        assert (hashes[0], "disk") in stored and (hashes[0], "host") in removed
        assert (hashes[3], "host") in stored
        # A prefix split over tiers: 0-1 on disk, 2-3 in host, loaded in one go.
        assert tc.lookup(hashes) == 4
        kv = torch.zeros(LAYOUT.tensor_shape(8))
        assert tc.load(hashes, [7, 1, 5, 3], kv) == 4
        assert torch.equal(kv[[7, 1, 5, 3]], data[:4])
        s = tc.stats()
        assert s.hits == {"disk": 2, "host": 2}
        assert s.bytes_loaded["disk"] == 2 * LAYOUT.block_bytes
        tc.put(hashes[4:6], list(data[4:6]))  # host -> disk, disk full: LRU dropped
        assert (hashes[0], "disk") in [e for ev in events for e in ev[2]]
        assert tc.stats().blocks == {"host": 2, "disk": 3}
        tc.check_integrity()
        assert sorted(tc.holdings()) == sorted(
            [(h, "host") for h in hashes[4:6]] + [(h, "disk") for h in hashes[1:4]])


def test_save_copies_device_blocks_off_thread_and_reports_them_done():
    cfg = TierConfig(host_blocks=8)
    with TieredCache(cfg, LAYOUT) as tc:
        hashes, data = make_blocks(3)
        kv = torch.zeros(LAYOUT.tensor_shape(6))
        kv[[4, 0, 2]] = data
        assert sorted(tc.save(hashes, [4, 0, 2], kv)) == [0, 2, 4]
        done: list[int] = []
        for _ in range(100):
            done += tc.take_saved(timeout=0.05)
            if len(done) == 3:
                break
        assert sorted(done) == [0, 2, 4]
        assert tc.wait_idle(5.0) and tc.lookup(hashes) == 3
        assert tc.save(hashes, [4, 0, 2], kv) == []  # already in host: nothing to hold
        out = torch.zeros_like(kv)
        assert tc.load(hashes, [1, 3, 5], out) == 3
        assert torch.equal(out[[1, 3, 5]], data)


def test_fp8_blocks_round_trip_host_and_disk_exactly(tmp_path):
    """An FP8 cache's blocks (--kv-cache-dtype fp8) through the host tier and, demoted,
    the disk tier: bit-exact, at one byte a value (half a bfloat16 block's bytes)."""
    fp8 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4,
                   dtype="float8_e4m3fn")
    bf16 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")
    assert fp8.block_bytes * 2 == bf16.block_bytes
    hashes, data = make_blocks(4, layout=fp8)
    data = data.to(torch.float8_e4m3fn)
    cfg = TierConfig(host_blocks=2, disk_dir=str(tmp_path), disk_blocks=4)
    with TieredCache(cfg, fp8) as tc:
        tc.put(hashes[:2], list(data[:2]))
        tc.put(hashes[2:], list(data[2:]))  # host full: blocks 0, 1 go to disk
        assert tc.stats().blocks == {"host": 2, "disk": 2}
        kv = torch.zeros(fp8.tensor_shape(6), dtype=torch.float8_e4m3fn)
        assert tc.load(hashes, [5, 1, 3, 0], kv) == 4
        assert torch.equal(kv[[5, 1, 3, 0]].view(torch.uint8), data.view(torch.uint8))
        s = tc.stats()
        assert s.bytes_loaded == {"disk": 2 * fp8.block_bytes, "host": 2 * fp8.block_bytes}
        tc.check_integrity()
