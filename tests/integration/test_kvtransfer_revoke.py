"""The in-place writers' revocable grant (`kvtransfer/inplace.py`): a transfer that
fails while its sender holds the grant keeps its cells until the sender gives the grant
back (REVOKED) or the grant's bound passes; a write landing meanwhile is dropped and
counted; the blocks are expected again afterwards."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kvtransfer import Region, TransferCancelled, TransferTimeout
from tests.integration.kvtransfer_util import (
    IN_PLACE,
    LAYOUT_BF16,
    LAYOUT_F32,
    STALE,
    Gate,
    connected,
    fast_config,
    sender_child,
    until,
)

pytestmark = pytest.mark.usefixtures("no_leaks")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", IN_PLACE)
@pytest.mark.parametrize("fails_by", ["cancel", "lease"])
def test_a_revoke_with_a_write_in_flight_waits_for_it(transport: str, fails_by: str) -> None:
    async def main() -> None:
        config = fast_config(transport)
        async with connected(config, LAYOUT_BF16, 8, 4, seed=3) as (receiver, sender, peer):
            landed = receiver.expect("x", [Region(5), Region(2), Region(6)], 1,
                                     lease_s=0.6 if fails_by == "lease" else None)
            await sender.begin(peer, [Region(5), Region(2), Region(6)], "x", 1)
            await sender.write(peer, [Region(0)], [Region(5)], "x", 1)
            # the second chunk has its cells, and waits for its forward
            write = asyncio.create_task(sender.write(peer, [Region(1)], [Region(2)], "x", 1,
                                                     ready=gate))
            await until(lambda: peer.grants[("x", 1)].inflight == 1)
            if fails_by == "cancel":
                assert receiver.cancel("x", "client cancelled")
            await asyncio.sleep(0.9)  # (well past the lease)
            assert not landed.done(), "the cells were let go with a write in flight"
            assert receiver.metrics.value(STALE) == 0
            gate.event.set()
            await asyncio.wait_for(write, 5)  # copied, its notice sent (and dropped)
            t0 = time.monotonic()
            error = TransferCancelled if fails_by == "cancel" else TransferTimeout
            with pytest.raises(error):
                await asyncio.wait_for(landed, 5)
            assert time.monotonic() - t0 < config.io_timeout_s, "given back, not timed out"
            assert receiver.metrics.value(STALE) == 1  # the late write: dropped, counted
            with pytest.raises(error):
                await sender.write(peer, [Region(2)], [Region(6)], "x", 1)
            with pytest.raises(error):
                await sender.finish(peer, "x", 1)
            assert not peer.grants and not receiver._grants
            receiver.table.check_integrity()
            # the blocks are free: the next transfer into them completes
            again = receiver.expect("x", [Region(5), Region(2)], 2)
            await sender.begin(peer, [Region(5), Region(2)], "x", 2)
            await sender.write(peer, [Region(2), Region(3)], [Region(5), Region(2)], "x", 2)
            await sender.finish(peer, "x", 2)
            await asyncio.wait_for(again, 5)
            src = sender.kv.tensor
            for s, d in ((2, 5), (3, 2)):
                assert torch.equal(receiver.kv.tensor[d].view(torch.int16),
                                   src[s].view(torch.int16))

    with Gate() as gate:
        asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", IN_PLACE)
def test_a_sender_that_never_answers_is_bounded(transport: str) -> None:
    """The sender holds its grant and stops (SIGSTOP) after its first chunk: the
    transfer is cancelled, the REVOKE goes unanswered, and the blocks are freed once the
    grant's bound (io_timeout_s + the copy budget + a margin past the sender's last
    frame) passed, not before."""
    # a copy budget over the grant margin (`inplace`): a receiver that ignores it frees early
    ttl, budget = 1.0, 1.0
    config = fast_config(transport, io_timeout_s=ttl, copy_budget_s=budget)
    plan = [{"xfer": "r1", "gen": 1, "src": [[[0]], [[1]]], "dst": [[[5]], [[9]]]}]

    async def main() -> None:
        async with sender_child(config, LAYOUT_F32, 16, 4, plan,
                                stop_after_first_write=True) as (receiver, peer):
            future = receiver.expect("r1", [Region(5), Region(9)], 1, lease_s=60.0)
            await peer.start()
            assert (await peer.line())["ready"]
            assert (await peer.line())["stopping"]
            stopped = time.monotonic()
            receiver.cancel("r1", "lease expired")
            # the bound covers a copy started just inside the grant (its copy budget)
            await asyncio.sleep(ttl + budget - 0.3)
            assert not future.done(), "blocks freed inside the grant's bound"
            with pytest.raises(TransferCancelled):
                await asyncio.wait_for(future, ttl + 3)
            assert time.monotonic() - stopped >= ttl + budget
            assert not receiver._grants
            receiver.table.check_integrity()
            receiver.expect("r1", [Region(5), Region(9)], 2)  # the blocks are free again
            receiver.cancel("r1")

    asyncio.run(main())
