"""A float8 decode never reads blocks without the scales they were written under: the
prefill's dtype must match at the kvtransfer handshake (tests/integration/
test_kvtransfer_transports.py: test_fp8_and_bf16_peers_are_refused), a sender of another
protocol version is refused there too (test_wire_version.py), and blocks that land
without scales fail the hand-off, which the failure policy then handles (recompute),
instead of being read under this worker's scales."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtransfer import ProtocolError
from tests.integration.kvtransfer_util import LAYOUT_BF16, LAYOUT_FP8, fast_config
from worker.config import WorkerConfig
from worker.handoff import HandoffConfig, HandoffConnector


async def _decode_side(layout: Any) -> tuple[HandoffConnector, list[Any]]:
    # the connector reads only its worker's role and id
    worker: Any = SimpleNamespace(config=WorkerConfig(role="decode", worker_id="decode-0"))
    handoff = HandoffConnector(HandoffConfig(fast_config("tcp")), worker)
    accepted: list[Any] = []

    async def accept(ids: list[int], scales: list[float]) -> None:
        accepted.append((ids, scales))

    handoff.accept = accept
    kv = torch.zeros(layout.tensor_shape(4), dtype=getattr(torch, layout.dtype))
    await handoff.start(kv, layout, shared=False)
    return handoff, accepted


def test_float8_blocks_that_land_without_scales_fail_the_hand_off() -> None:
    async def main() -> None:
        handoff, accepted = await _decode_side(LAYOUT_FP8)
        try:
            with pytest.raises(ProtocolError, match="without the sender's KV scales"):
                await handoff._landed([0, 1], [])
            assert accepted == []
            scales = [0.5, 0.25] * LAYOUT_FP8.num_layers
            await handoff._landed([0, 1], scales)
            assert accepted == [([0, 1], scales)]
        finally:
            await handoff.close()

    asyncio.run(main())


def test_other_caches_take_blocks_without_scales() -> None:
    async def main() -> None:
        handoff, accepted = await _decode_side(LAYOUT_BF16)
        try:
            await handoff._landed([0, 1], [])
            assert accepted == []
        finally:
            await handoff.close()

    asyncio.run(main())
