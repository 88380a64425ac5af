"""cuda_ipc's pieces that need no second process: the batched gather-scatter kernel
(Triton's interpreter on the CPU; the same kernel runs on the GPU), the node check
that refuses a sender on another node with an error naming `ucx`, and the decision
between GPUs (by UUID, node and peer access) that `cuda_ipc` enforces and `auto`
follows."""

from __future__ import annotations

import asyncio
import importlib.util
import random

import pytest
import torch

from kvtransfer import PeerUnavailable, ProtocolError, Region
from kvtransfer.scatter_copy import scatter_copy
from tests.integration.kvtransfer_util import (
    LAYOUT_BF16,
    connected,
    fast_config,
    start_receiver,
    start_sender,
)


@pytest.mark.parametrize("word", [1, 2, 8])
def test_scatter_copy_moves_every_region_and_nothing_else(word: int) -> None:
    rng = random.Random(word)
    src = torch.randint(0, 255, (1 << 16,), dtype=torch.uint8)
    dst = torch.zeros(1 << 17, dtype=torch.uint8)
    # Scattered destinations of mixed sizes (partial layers and whole blocks), one launch.
    slots = rng.sample(range((1 << 17) // 2048), 12 - word % 2)  # an odd count pads the table
    regions = [(rng.randrange(0, (1 << 16) - 2048) // word * word, slot * 2048,
                rng.choice([word, 256, 2048 - word]) // word * word) for slot in slots]
    scatter_copy(src, dst, regions)
    untouched = torch.ones_like(dst, dtype=torch.bool)
    for s, d, n in regions:
        assert torch.equal(dst[d:d + n], src[s:s + n])
        untouched[d:d + n] = False
    assert not dst[untouched].any()


def test_a_sender_on_another_node_is_refused_naming_ucx() -> None:
    async def main() -> None:
        config = fast_config("cuda_ipc")
        receiver = await start_receiver(config, LAYOUT_BF16, 8)
        receiver._exported["boot_id"] = "another-node"  # as a receiver elsewhere reports
        sender = start_sender(config, LAYOUT_BF16, 8, seed=1)
        future = receiver.expect("x", [Region(1)], 1)
        try:
            with pytest.raises(ProtocolError, match="--transport ucx"):
                await sender.connect(receiver.address())
            assert not future.done() and not receiver.kv.tensor.any()
        finally:
            await sender.close()
            await receiver.close()

    asyncio.run(main())


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx not installed")
def test_auto_maps_the_cache_on_one_node_and_puts_over_ucx_from_another() -> None:
    """One `auto` receiver, two senders: the local one takes the cuda_ipc path (here
    its host mover), the one that sees another boot id the ucx path; both land
    bit-exact under the receiver's one fence table."""
    from kvtransfer.auto import AutoSender

    async def main() -> None:
        config = fast_config("auto")
        receiver = await start_receiver(config, LAYOUT_BF16, 16)
        local, remote = (start_sender(config, LAYOUT_BF16, 8, seed=s) for s in (1, 2))
        assert isinstance(local, AutoSender) and isinstance(remote, AutoSender)
        try:
            near = await local.connect(receiver.address())
            receiver._exported["boot_id"] = "another-node"  # as seen from elsewhere
            far = await remote.connect(receiver.address())
            assert local.paths[id(near)] == "cuda_ipc" and remote.paths[id(far)] == "ucx"
            futures = [receiver.expect(x, [Region(d) for d in dst], 1)
                       for x, dst in (("a", [3, 11]), ("b", [7, 0]))]
            await local.write(near, [Region(1), Region(2)], [Region(3), Region(11)], "a", 1)
            await remote.write(far, [Region(4), Region(5)], [Region(7), Region(0)], "b", 1)
            await local.finish(near, "a")
            await remote.finish(far, "b")
            await asyncio.wait_for(asyncio.gather(*futures), 5)
            kv = receiver.kv.tensor
            for dst, sender, src in ((3, local, 1), (11, local, 2), (7, remote, 4),
                                     (0, remote, 5)):
                assert torch.equal(kv[dst].view(torch.int16), sender.kv.tensor[src].view(torch.int16))
            receiver.table.check_integrity()
        finally:
            await local.close()
            await remote.close()
            await receiver.close()

    asyncio.run(main())


def _welcome(node: str = "n1", kind: str = "cuda", gpu: str | None = "GPU-b") -> dict:
    exported = {"kind": kind, **({"gpu": gpu} if gpu is not None else {})}
    return {"boot_id": node, "cuda_ipc": exported}


# This sender: on GPU-a (its cuda:0); it also sees GPU-b as cuda:1, and GPU-c as cuda:2,
# which is not a P2P peer of cuda:0.
_GPUS = {"GPU-a": 0, "GPU-b": 1, "GPU-c": 2}


def _refusal(welcome: dict, own_gpu: int = 0, gpus: dict | None = None) -> str | None:
    from kvtransfer.cuda_ipc import ipc_refusal

    return ipc_refusal(welcome, node="n1", kind="cuda", own_gpu=own_gpu,
                       gpus=_GPUS if gpus is None else gpus,
                       can_access=lambda a, b: {a, b} == {0, 1})


def test_ipc_path_between_gpus_is_decided_by_uuid_node_and_peer_access() -> None:
    # The same GPU, found by UUID whatever its ordinal in the receiver's process.
    assert _refusal(_welcome(gpu="GPU-a")) is None
    # Another GPU that is a P2P peer: the cross-GPU path.
    assert _refusal(_welcome(gpu="GPU-b")) is None
    assert _refusal(_welcome(gpu="GPU-a"), own_gpu=1) is None
    no_p2p = _refusal(_welcome(gpu="GPU-c"))
    assert no_p2p is not None and "cannot access cuda:2 as a peer" in no_p2p
    hidden = _refusal(_welcome(gpu="GPU-b"), gpus={"GPU-a": 0})
    assert hidden is not None and "not visible" in hidden and "--device cuda:N" in hidden
    other_node = _refusal(_welcome(node="n2", gpu="GPU-a"))
    assert other_node is not None and "--transport ucx" in other_node
    assert "host memory" in (_refusal(_welcome(kind="host")) or "")
    assert "does not name its GPU" in (_refusal(_welcome(gpu=None)) or "")
    assert "without an exported cache" in (_refusal({"boot_id": "n1"}) or "")


def test_host_caches_need_only_the_node() -> None:
    from kvtransfer.cuda_ipc import ipc_refusal

    same = ipc_refusal(_welcome(kind="host", gpu=None), node="n1", kind="host",
                       own_gpu=None, gpus=None, can_access=None)
    assert same is None
    assert ipc_refusal(_welcome(node="n2", kind="host", gpu=None), node="n1", kind="host",
                       own_gpu=None, gpus=None, can_access=None) is not None


def test_auto_takes_the_ipc_path_exactly_when_the_sender_can_map_the_cache() -> None:
    """`auto`'s choice is `local_refusal` being None: with host caches (these tests'),
    same node -> cuda_ipc; the decision for GPUs is the pure one above."""
    from kvtransfer.cuda_ipc import boot_id, local_refusal
    from kvtransfer.memory import RegisteredKV
    from tests.integration.kvtransfer_util import make_kv

    kv = RegisteredKV(make_kv(LAYOUT_BF16, 4, 1), LAYOUT_BF16)
    here = {"boot_id": boot_id(), "cuda_ipc": {"kind": "host"}}
    assert local_refusal(here, kv) is None
    assert local_refusal({**here, "boot_id": "elsewhere"}, kv) is not None


def test_chunk_writes_return_before_their_copies_and_land_in_order() -> None:
    """Many one-block writes of one transfer (the host mover: copies on their own
    thread, none inline here, each notice sent once its copy completed), then finish:
    every block lands bit-exact; a copy that fails (the peer's memory gone) fails the
    transfer."""
    import os

    async def main() -> None:
        async with connected(fast_config("cuda_ipc"), LAYOUT_BF16, 32, 16,
                             seed=3) as (receiver, sender, peer):
            sender._mover.inline_bytes = 0
            src, dst = list(range(16)), random.Random(5).sample(range(32), 16)
            landed = receiver.expect("x", [Region(d) for d in dst], 1)
            await sender.begin(peer, [Region(d) for d in dst], "x", 1)
            for s, d in zip(src, dst, strict=True):
                await sender.write(peer, [Region(s)], [Region(d)], "x", 1)
            await sender.finish(peer, "x")
            await asyncio.wait_for(landed, 5)
            got = receiver.kv.tensor[dst].view(torch.uint8)
            assert torch.equal(got, sender.kv.tensor[src].view(torch.uint8))
            assert peer.notices is None  # every deferred notice went out

            receiver.expect("y", [Region(0)], 1)
            peer.state = (os.getpid(), 8, 32)  # unmapped: process_vm_writev faults
            with pytest.raises(PeerUnavailable, match="process_vm_writev"):
                await sender.write(peer, [Region(1)], [Region(0)], "y", 1)
                await sender.finish(peer, "y")  # where the write deferred its notice

    asyncio.run(main())
