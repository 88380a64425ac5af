"""cuda_ipc between two GPUs of one node: the prefill's process on one GPU writes into
the decode's cache on another through peer access (NVLink / PCIe), one launch per
chunk, bit-exact; `auto` takes that path when the sender sees both GPUs, and a sender
that sees only its own GPU is refused naming the fix (cuda_ipc) or put over ucx (auto).
Needs two GPUs that are P2P peers (skipped on fewer: a one-GPU machine runs none)."""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest
import torch

from kvtransfer import Region
from tests.integration.kvtransfer_util import (
    LAYOUT_BF16,
    PeerProcess,
    fast_config,
    make_kv,
    spec,
    start_receiver,
)
from tests.integration.test_kvtransfer_transports import N_XFERS, SRC_BLOCKS, make_plan

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]
_NO_UCXX = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                              reason="ucxx not installed (bench/gpu_wheels.sh: carry the wheels)")


def _peers() -> None:
    if torch.cuda.device_count() >= 2 and not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("cuda:0 and cuda:1 are not P2P peers")


async def _round_trip(transport: str, sender_device: str, env: dict[str, str] | None,
                      receiver_device: str = "cuda:1") -> str:
    """20 transfers from a sender process on `sender_device` into a receiver here on
    `receiver_device`; checks every byte; returns the path the sender took."""
    config = fast_config(transport)
    receiver = await start_receiver(config, LAYOUT_BF16, 128, device=receiver_device)
    plan = make_plan(LAYOUT_BF16, seed=17)
    futures = [receiver.expect(t["xfer"], [Region(*e) for e in t["expect"]], t["gen"])
               for t in plan]
    peer = await PeerProcess(spec("sender", config, LAYOUT_BF16, SRC_BLOCKS, plan,
                                  address=receiver.address(), device=sender_device),
                             env).start()
    try:
        ready = await peer.line(60)
        assert ready["ready"], ready
        results = await peer.lines(N_XFERS, 60)
        await asyncio.wait_for(asyncio.gather(*futures), 30)
        assert all(r["ok"] for r in results), results
        assert await peer.wait() == 0
        torch.cuda.synchronize(receiver_device)
        got = receiver.kv.tensor.cpu()
        src = make_kv(LAYOUT_BF16, SRC_BLOCKS, 1234)
        touched = torch.zeros(got.shape[:2], dtype=torch.bool)
        for t in plan:
            for srcs, dsts in zip(t["src"], t["dst"], strict=True):
                for s, d in zip(srcs, dsts, strict=True):
                    ls, le = (s[1], s[2]) if len(s) > 1 else (0, got.shape[1])
                    assert torch.equal(got[d[0], ls:le].view(torch.int16),
                                       src[s[0], ls:le].view(torch.int16)), t["xfer"]
                    touched[d[0], ls:le] = True
        assert not got[~touched].any(), "bytes landed outside the destination"
        receiver.table.check_integrity()
        return str(ready["path"])
    finally:
        await peer.aclose()
        await receiver.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["cuda_ipc", pytest.param("auto", marks=_NO_UCXX)])
def test_cross_gpu_round_trip_bit_exact(transport: str) -> None:
    _peers()
    path = asyncio.run(_round_trip(transport, "cuda:0", None))
    assert path == "cuda_ipc"


@pytest.mark.timeout(120)
def test_cross_gpu_with_renumbered_devices() -> None:
    """The sender sees the GPUs in another order (CUDA_VISIBLE_DEVICES=1,0): its cuda:1
    is the receiver's cuda:0. The export's GPU UUID, not an ordinal, finds it."""
    _peers()
    env = {"CUDA_VISIBLE_DEVICES": "1,0"} if "CUDA_VISIBLE_DEVICES" not in os.environ else None
    if env is None:
        pytest.skip("CUDA_VISIBLE_DEVICES is set here; the test renumbers from the default")
    assert asyncio.run(_round_trip("cuda_ipc", "cuda:0", env, receiver_device="cuda:0")) \
        == "cuda_ipc"


@pytest.mark.timeout(120)
def test_a_sender_that_cannot_see_the_receivers_gpu_is_refused() -> None:
    async def main() -> None:
        config = fast_config("cuda_ipc")
        receiver = await start_receiver(config, LAYOUT_BF16, 16, device="cuda:1")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")[0]
        peer = await PeerProcess(spec("sender", config, LAYOUT_BF16, SRC_BLOCKS, [],
                                      address=receiver.address(), device="cuda:0"),
                                 {"CUDA_VISIBLE_DEVICES": visible}).start()
        try:
            line = await peer.line(60)
            assert line["connect"] is False and "not visible" in line["message"], line
            assert "--transport ucx" in line["message"]
        finally:
            await peer.aclose()
            await receiver.close()

    asyncio.run(main())


@_NO_UCXX
@pytest.mark.timeout(120)
def test_auto_puts_over_ucx_when_the_receivers_gpu_is_hidden() -> None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")[0]
    path = asyncio.run(_round_trip("auto", "cuda:0", {"CUDA_VISIBLE_DEVICES": visible}))
    assert path == "ucx"
