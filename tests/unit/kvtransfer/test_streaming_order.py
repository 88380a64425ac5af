"""Layer-wise streaming's ordering, on the CPU: each chunk's KV goes out tagged with the
point at which that chunk's forward finished (on CUDA the event the engine recorded on
its compute stream), and no transport moves a byte of a write before that point. On
the GPU the point is a `torch.cuda.Event` the copy stream waits on, so chunk c's copy
overlaps chunk c+1's forward (tests/gpu/test_cuda_transfer.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.llm import make_engine_config
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kvtransfer import Region
from tests.factories import tiny_model_dir
from tests.integration.kvtransfer_util import LAYOUT_BF16, TRANSPORTS, Gate, connected, fast_config


class _StepMark:
    """Stands in for the CUDA event of one engine step (no device here)."""

    def __init__(self, step: int) -> None:
        self.step = step


def test_each_chunk_carries_the_mark_of_the_step_that_computed_it() -> None:
    engine = LLMEngine(make_engine_config(tiny_model_dir("llama"), dtype="float32",
                                          block_size=4, num_blocks=32,
                                          max_num_batched_tokens=8))
    marks: list[_StepMark] = []

    def record() -> _StepMark:  # what ModelRunner.record_kv_ready returns on CUDA
        marks.append(_StepMark(len(marks)))
        return marks[-1]

    engine.runner.record_kv_ready = record  # type: ignore[method-assign,assignment]
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request("producer", list(range(10, 30)), params, hold_kv=True)
    engine.add_request("plain", list(range(40, 43)),
                       SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    seen: list[tuple[int, int]] = []  # (tokens computed, step of its mark)
    steps = 0
    while engine.has_work():
        for out in engine.step():
            if out.request_id == "plain":
                assert out.kv_ready is None  # not a producer: nothing to stream
                continue
            assert out.kv_ready is marks[-1], "a chunk tagged with another step's event"
            seen.append((out.num_computed_tokens, out.kv_ready.step))
        steps += 1
    # 20 tokens in chunks of at most 8 (the plain request shares the first step); one
    # mark per step that ran the producer, none after it finished.
    assert [n for n, _ in seen] == sorted({n for n, _ in seen}) and seen[-1][0] == 20
    assert [s for _, s in seen] == list(range(len(seen))) == [m.step for m in marks]
    assert steps > len(marks)  # the plain request decoded on without events
    engine.release("producer")
    engine.check_integrity()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_write_moves_nothing_before_its_chunk_is_ready(transport: str) -> None:
    async def main() -> None:
        async with connected(fast_config(transport), LAYOUT_BF16, 8, 4,
                             seed=3) as (receiver, sender, peer):
            future = receiver.expect("x", [Region(5), Region(2)], 1)
            write = asyncio.create_task(sender.write(
                peer, [Region(1), Region(3)], [Region(5), Region(2)], "x", 1, ready=gate))
            await asyncio.sleep(0.3)
            dst = receiver.kv.tensor
            assert not write.done() and not dst.any(), "bytes moved before the chunk was ready"
            gate.event.set()
            await asyncio.wait_for(write, 5)
            await sender.finish(peer, "x")
            await asyncio.wait_for(future, 5)
            src = sender.kv.tensor
            for s, d in ((1, 5), (3, 2)):
                assert torch.equal(dst[d].view(torch.int16), src[s].view(torch.int16))

    with Gate() as gate:
        asyncio.run(main())
