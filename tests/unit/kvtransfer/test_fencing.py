"""TransferTable (leases, fencing) and layout arithmetic, without sockets."""

from __future__ import annotations

import asyncio

import pytest

from kvtransfer import KVLayout, LayoutMismatch, Region, coalesce
from kvtransfer.errors import IntegrityError, TransferCancelled, TransferTimeout
from kvtransfer.fencing import TransferTable
from kvtransfer.metrics import TransferMetrics

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")


def make_table() -> TransferTable:
    return TransferTable(LAYOUT, 32, TransferMetrics("receiver", "test"))


def test_region_bytes_and_coalescing() -> None:
    assert Region(2, 1, 3).resolve(LAYOUT, 32) == (2 * LAYOUT.block_bytes + LAYOUT.layer_bytes,
                                                   2 * LAYOUT.layer_bytes)
    pairs = coalesce([Region(0), Region(1), Region(2)], [Region(7), Region(8), Region(3)], LAYOUT)
    assert pairs == [(Region(0, 0, None, 2), Region(7, 0, None, 2)), (Region(2), Region(3))]
    with pytest.raises(ValueError):
        Region(31, 0, None, 2).resolve(LAYOUT, 32)
    with pytest.raises(LayoutMismatch, match="dtype"):
        LAYOUT.check_same(KVLayout(4, 2, 8, 4, "float32"))


@pytest.mark.timeout(60)
def test_completion_fires_once_all_cells_landed() -> None:
    async def main() -> None:
        table = make_table()
        fut = table.expect("x", [Region(3), Region(9, 1, 3)], 1, lease_s=5)
        for layer in range(4):
            assert table.admit("x", 1, Region(3, layer, layer + 1), writer=1)
            table.landed("x", Region(3, layer, layer + 1))
        assert not fut.done()
        assert not table.admit("x", 1, Region(9, 0, 1), writer=1)  # not expected
        with pytest.raises(Exception, match="not expected"):
            await fut
        table.check_integrity()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_fenced_generation_drops_late_writes_and_lease_expires() -> None:
    async def main() -> None:
        table = make_table()
        fut = table.expect("x", [Region(3)], 1, lease_s=5)
        table.cancel("x")
        with pytest.raises(TransferCancelled):
            await fut
        assert not table.admit("x", 1, Region(3), writer=1)
        assert table.metrics.value("splitserve:kv_transfer_stale_writes_dropped_total") == 1
        with pytest.raises(ValueError):
            table.expect("x", [Region(3)], 1, lease_s=5)  # fenced generation
        short = table.expect("x", [Region(3)], 2, lease_s=0.05)
        with pytest.raises(TransferTimeout):
            await short
        corrupt = table.expect("y", [Region(4)], 1, lease_s=5)
        assert table.admit("y", 1, Region(4), writer=2)
        table.landed("y", Region(4), ok=False)
        with pytest.raises(IntegrityError):
            await corrupt
        table.check_integrity()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_completed_transfer_is_observed_once_with_its_bytes() -> None:
    """Each hand-off is one observation of kv_transfer_seconds and of
    kv_transfer_request_bytes (its bytes); a failed one is neither."""
    async def main() -> None:
        table = make_table()
        fut = table.expect("x", [Region(3), Region(5, 1, 3)], 1, lease_s=5)
        for region in (Region(3), Region(5, 1, 3)):
            assert table.admit("x", 1, region, writer=1)
            table.landed("x", region)
        await fut
        failed = table.expect("y", [Region(4)], 1, lease_s=5)
        table.cancel("y")
        with pytest.raises(TransferCancelled):
            await failed
        value = table.metrics.value
        assert value("splitserve:kv_transfer_request_bytes_count") == 1
        assert value("splitserve:kv_transfer_seconds_count") == 1
        assert value("splitserve:kv_transfer_request_bytes_sum") \
            == LAYOUT.block_bytes + 2 * LAYOUT.layer_bytes \
            == value("splitserve:kv_transfer_bytes_total")
        assert value("splitserve:kv_transfer_request_bytes_bucket", le="16384.0") == 1

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_future_its_caller_cancelled_still_resolves_the_transfer() -> None:
    """A caller's wait_for that timed out cancels the transfer's future: the transfer
    still ends (its blocks freed, a write in flight released) without an error."""
    async def main() -> None:
        table = make_table()
        for xfer, fail in (("x", True), ("y", False)):
            fut = table.expect(xfer, [Region(3)], 1, lease_s=5)
            assert table.admit(xfer, 1, Region(3), writer=1)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(fut, 0.01)
            assert fut.cancelled()
            if fail:
                table.cancel(xfer)
                table.released(xfer, TransferCancelled("writer gone"))
            else:
                table.landed(xfer, Region(3))
            assert not table.is_live(xfer, 1)
            table.check_integrity()

    asyncio.run(main())
