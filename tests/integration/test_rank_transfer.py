"""Per-rank hand-off between tensor-parallel workers' KV caches, every transport (tcp,
shm, ucx; sender and receiver in one process): each destination rank's cache receives
exactly its KV heads from the source rank(s) holding them, bit-exact, under the
destination's block ids; other blocks stay untouched; the transfer completes only once
every rank's slices landed."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from typing import Any

import pytest
import torch

from engine.rank_segments import RankSegment, unlink_segments
from kvtransfer import KVLayout, make_receiver, make_sender
from kvtransfer.layout import Region, head_map, whole_blocks
from kvtransfer.memory import RankCaches
from tests.integration.kvtransfer_util import fast_config

SRC, DST = [3, 4, 5, 9], [10, 2, 3, 7]  # 4, 5 -> 2, 3: one region of two blocks
NUM_BLOCKS = 16
UCX = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="no ucxx")
CASES = [(p, d, h) for h in (2, 1) for p, d in ((1, 2), (2, 1), (2, 2))]


def _layout(heads: int) -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=heads, head_dim=8, block_size=4,
                    dtype="float32")


def _shards(full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    return [full[..., a:b, :].contiguous() for a, b in head_map(full.shape[4], tp)]


async def _move(transport: str, p: int, d: int, heads: int, checksum: bool = True) -> None:
    layout = _layout(heads)
    full = torch.randn(layout.tensor_shape(NUM_BLOCKS), generator=torch.Generator()
                       .manual_seed(p * 10 + d))
    shape = _shards(full, d)[0].shape
    names = [f"splitserve-kv-test{os.getpid()}-{p}{d}{heads}-{transport}r{r}"
             for r in range(d)]
    segments = [RankSegment(n, tuple(shape), torch.float32, True) for n in names]
    receiver = make_receiver(fast_config(transport))
    sender = make_sender(fast_config(transport))
    try:
        dst = [s.tensor for s in segments]
        receiver.register(RankCaches(dst, names) if d > 1 or transport == "shm"
                          else dst[0], layout)
        await receiver.start()
        sender.register(RankCaches(_shards(full, p)) if p > 1 else full, layout)
        peer = await sender.connect(receiver.address())
        landed = receiver.expect("x", whole_blocks(DST), 1)
        await sender.begin(peer, whole_blocks(DST), "x", 1)
        await sender.write(peer, whole_blocks(SRC[:1]), whole_blocks(DST[:1]), "x", 1,
                           checksum=checksum)
        await asyncio.sleep(0.05)
        assert not landed.done()  # one block of four: not runnable yet
        await sender.write(peer, whole_blocks(SRC[1:]), whole_blocks(DST[1:]), "x", 1,
                           checksum=checksum)
        await sender.finish(peer, "x", 1)
        await asyncio.wait_for(landed, 5)
        want = torch.zeros_like(full)
        want[DST] = full[SRC]
        for got, expected in zip(dst, _shards(want, d), strict=True):
            assert torch.equal(got, expected)
        assert receiver.kv is not None and receiver.kv.tp == d
        receiver.table.check_integrity()
        remote = peer.state
        await sender.disconnect(peer)
        if transport == "ucx":
            await _closed(sender, remote)
    finally:
        await sender.close()
        await receiver.close()
        del segments
        unlink_segments(names)


async def _closed(sender: Any, remote: Any) -> None:
    """A ucx receiver the sender disconnected: its bounce buffers are freed and no batch
    issues on its released keys and endpoints any more."""
    from kvtransfer.errors import PeerUnavailable

    assert remote.closed
    assert remote.packer is None or remote.packer not in sender._packers
    with pytest.raises(PeerUnavailable):
        await sender._run(remote, "put", [[(0, 1, 0)]])


@pytest.mark.parametrize(("p", "d", "heads"), CASES)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_each_rank_receives_its_heads(transport: str, p: int, d: int, heads: int) -> None:
    asyncio.run(_move(transport, p, d, heads))


@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1)])
def test_tcp_moves_a_head_slice_a_block_at_a_time(monkeypatch, p: int, d: int,
                                                  checksum: bool) -> None:
    """tcp packs and lays a slice's runs in parts of whole blocks (here one block a
    part), the checksum over the whole payload."""
    monkeypatch.setattr("kvtransfer.tcp._SLICE_PART_BYTES", 1)
    asyncio.run(_move("tcp", p, d, 2, checksum))


@UCX
@pytest.mark.parametrize(("p", "d", "heads"), [(1, 2, 2), (2, 1, 2), (2, 2, 1), (2, 4, 4),
                                               (4, 2, 4)])
def test_each_rank_receives_its_heads_over_ucx(p: int, d: int, heads: int) -> None:
    asyncio.run(_move("ucx", p, d, heads))


@UCX
@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1)])
def test_ucx_packs_head_slices_a_block_at_a_time(monkeypatch, p: int, d: int) -> None:
    """ucx packs a destination rank's slices into bounce buffers of one block here: the
    two-block region goes as two tiles, the buffers refilled once their puts flushed."""
    monkeypatch.setattr("kvtransfer.ucx._BOUNCE_BYTES", 1)
    asyncio.run(_move("ucx", p, d, 2))


def test_a_failed_slice_of_any_rank_fails_the_whole_transfer() -> None:
    from kvtransfer.errors import IntegrityError
    from kvtransfer.fencing import TransferTable
    from kvtransfer.layout import rank_layout
    from kvtransfer.metrics import TransferMetrics

    async def run() -> None:
        layout = rank_layout(_layout(2), 2)
        table = TransferTable(layout, NUM_BLOCKS, TransferMetrics("receiver", "tcp"), tp=2)
        done = table.expect("x", [Region(5, rank=0), Region(5, rank=1)], 1, 10.0)
        assert table.admit("x", 1, Region(5, rank=0), 1)
        table.landed("x", Region(5, rank=0))
        assert not done.done()  # rank 1's heads still missing
        assert not table.admit("x", 1, Region(5, rank=2), 1)  # no such rank: fails it
        with pytest.raises(Exception, match="outside 2 rank"):
            await done
        done = table.expect("y", [Region(6, rank=0), Region(6, rank=1)], 1, 10.0)
        assert table.admit("y", 1, Region(6, rank=1), 1)
        table.landed("y", Region(6, rank=1), ok=False)
        with pytest.raises(IntegrityError):
            await done

    asyncio.run(run())
