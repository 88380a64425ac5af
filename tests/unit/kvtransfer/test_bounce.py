"""`kvtransfer.bounce`: the head slices between TP sizes grouped into tiles (one
destination rank's every head of a region) and packed as the destination's bytes, so
ucx puts a tile whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtransfer.bounce import batches, pack, tiles
from kvtransfer.layout import KVLayout, Region, head_map, rank_layout, rank_pairs
from kvtransfer.memory import RankCaches, RegisteredKV

NUM_BLOCKS = 10
LAYOUT = KVLayout(num_layers=3, num_kv_heads=8, head_dim=4, block_size=4, dtype="bfloat16")
PAIRS = [(Region(0, num_blocks=3), Region(5, num_blocks=3)), (Region(6), Region(1)),
         (Region(8, layer_start=1, layer_end=3), Region(9, layer_start=1, layer_end=3))]


def _shards(full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    return [full[..., a:b, :].contiguous() for a, b in head_map(full.shape[4], tp)]


def _kv(full: torch.Tensor, tp: int) -> RegisteredKV:
    return RegisteredKV(RankCaches(_shards(full, tp)) if tp > 1 else full, LAYOUT)


@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1), (2, 4), (4, 2), (1, 8), (4, 8)])
@pytest.mark.parametrize("max_bytes", [1, 1 << 20])
def test_tiles_pack_into_the_destination_ranks_bytes(p: int, d: int, max_bytes: int) -> None:
    full = torch.randn(LAYOUT.tensor_shape(NUM_BLOCKS)).to(torch.bfloat16)
    kv = _kv(full, p)
    there = rank_layout(LAYOUT, d)
    # what each destination rank holds once the pairs moved
    want = torch.zeros_like(full)
    for s, t in PAIRS:
        a, b = s.layers(LAYOUT)
        want[t.block_id:t.block_id + t.num_blocks, a:b] = \
            full[s.block_id:s.block_id + s.num_blocks, a:b]
    want_ranks = [w.view(-1).view(torch.uint8).numpy() for w in _shards(want, d)]
    pairs = rank_pairs(PAIRS, LAYOUT.num_kv_heads, p, d)
    got, rest = tiles(pairs, kv.rank_layout, there, max_bytes)
    assert rest == []  # p != d: every pair is a slice on one side, and they tile
    assert sum(t.nbytes for t in got) == sum(kv.region_bytes(s) for s, _ in pairs)
    if max_bytes == 1:  # cut to a block a tile
        assert all(t.dst.num_blocks == 1 for t in got)
    out = np.zeros(sum(t.nbytes for t in got), dtype=np.uint8)
    offsets = pack(kv, got, there, out)
    for tile, off in zip(got, offsets, strict=True):
        assert tile.dst.whole_heads(there)
        at, n = tile.dst.resolve(there, NUM_BLOCKS)
        assert n == tile.nbytes
        assert np.array_equal(out[off:off + n], want_ranks[tile.dst.rank][at:at + n])


def test_whole_rank_pairs_and_partial_groups_stay_as_they_are() -> None:
    there = rank_layout(LAYOUT, 2)
    same = rank_pairs(PAIRS[:1], 8, 2, 2)  # TP 2 -> 2: rank blocks, whole heads
    assert tiles(same, there, there, 1 << 20) == ([], same)
    pairs = rank_pairs(PAIRS[1:2], 8, 4, 2)  # two slices fill each destination rank
    got, rest = tiles(pairs[:3], rank_layout(LAYOUT, 4), there, 1 << 20)
    assert len(got) == 1 and got[0].dst.rank == 0 and rest == pairs[2:3]


def test_batches_hold_at_most_their_bytes_and_a_tile_at_least() -> None:
    there = rank_layout(LAYOUT, 2)
    got, _ = tiles(rank_pairs(PAIRS, 8, 1, 2), LAYOUT, there, 1)
    block = there.block_bytes
    for limit in (1, block, 2 * block + 1):
        cut = list(batches(got, limit))
        assert [t for b in cut for t in b] == got
        assert all(len(b) == 1 or sum(t.nbytes for t in b) <= limit for b in cut)
    # eight tiles of a block, then two of two layers in three: pairs to the limit
    assert [t.nbytes for t in got] == [block] * 8 + [2 * block // 3] * 2
    assert [len(b) for b in batches(got, 2 * block)] == [2, 2, 2, 2, 2]
    assert [len(b) for b in batches(got, 3 * block)] == [3, 3, 3, 1]


class _FakeUcp:
    """Registration bookkeeping only: the test's puts copy with memmove."""

    def __init__(self) -> None:
        self.mapped: set[int] = set()
        self.count = 0

    def mem_map(self, context: int, address: int, length: int, cuda: bool) -> int:
        self.count += 1
        self.mapped.add(self.count)
        return self.count

    def mem_unmap(self, context: int, memh: int) -> None:
        self.mapped.remove(memh)


def test_packer_pipeline_lands_every_tile_and_retires_buffers_on_failure() -> None:
    """Tiles packed two buffers in turn and put by a slow loopback 'put' (memmove after
    a pause): every destination byte right, so no buffer was refilled while its puts
    ran. A failed put retires the buffers until `release` of its receiver."""
    import asyncio
    import ctypes
    from typing import Any, cast

    from kvtransfer.bounce import Packer

    full = torch.randn(LAYOUT.tensor_shape(NUM_BLOCKS)).to(torch.bfloat16)
    kv, there = _kv(full, 2), rank_layout(LAYOUT, 1)
    dst = torch.zeros_like(full)
    got, _ = tiles(rank_pairs(PAIRS, 8, 2, 1), kv.rank_layout, there, 1)
    ucp = _FakeUcp()
    calls = {"n": 0, "fail_at": None}

    async def put(memhs: list[int], rows: dict[int, list[tuple[int, int, int]]]) -> None:
        assert set(memhs) <= ucp.mapped  # put from registered memory only
        calls["n"] += 1
        me = calls["n"]
        await asyncio.sleep(0.002)
        if me == calls["fail_at"]:
            raise RuntimeError("peer gone")
        for local, n, remote in rows[0]:
            ctypes.memmove(remote, local, n)

    async def main() -> None:
        packer = Packer(there.block_bytes)  # a block a batch: the buffers take turns
        base = [dst.data_ptr()]
        await packer.put(kv, got, there, base, put, cast(Any, ucp), [1], owner="a")
        want = torch.zeros_like(full)
        for s, t in PAIRS:
            a, b = s.layers(LAYOUT)
            want[t.block_id:t.block_id + t.num_blocks, a:b] = \
                full[s.block_id:s.block_id + s.num_blocks, a:b]
        assert torch.equal(dst, want) and calls["n"] == len(got)
        assert len(ucp.mapped) == 2  # two buffers, one lane each
        calls.update(n=0, fail_at=2)
        with pytest.raises(RuntimeError, match="peer gone"):
            await packer.put(kv, got, there, base, put, cast(Any, ucp), [1], owner="b")
        assert len(ucp.mapped) == 2  # retired, still registered (a put may read them)
        calls.update(n=0, fail_at=None)
        await packer.put(kv, got, there, base, put, cast(Any, ucp), [1], owner="a")
        assert len(ucp.mapped) == 4 and torch.equal(dst, want)  # fresh buffers
        packer.release("a", cast(Any, ucp))
        assert len(ucp.mapped) == 4  # nothing retired on a's account
        packer.release("b", cast(Any, ucp))
        assert len(ucp.mapped) == 2
        packer.close(cast(Any, ucp))
        assert not ucp.mapped

    asyncio.run(main())
