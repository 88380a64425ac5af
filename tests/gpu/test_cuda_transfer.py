"""KV hand-offs between two processes on one GPU (skipped without one): cuda_ipc and
ucx (RMA puts; UCX picks cuda_ipc / NVLink there) move bf16 CUDA caches bit-exactly
with scattered block ids and 20 transfers in flight; a wrong token is refused; a late
write after an abort is dropped; a killed sender or receiver ends in a typed error in
time; a chunk's copy waits on its own `ready` event, not on the compute queued after it
(layer-wise streaming); a closed sender leaves no IPC mapping or device memory behind;
and a 1P1D cluster on the GPU answers greedy requests exactly as a colocated worker."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import time
from typing import Any

import pytest
import torch

from kvtransfer import (
    PeerUnavailable,
    Region,
    TransferCancelled,
    TransferTimeout,
    make_sender,
    whole_blocks,
)
from tests.gpu.cuda_memory import holders, record
from tests.integration.kvtransfer_util import (
    LAYOUT_BF16,
    PeerProcess,
    fast_config,
    make_kv,
    spec,
    start_receiver,
)
from tests.integration.test_kvtransfer_transports import N_XFERS, SRC_BLOCKS, make_plan

pytestmark = pytest.mark.gpu
_NO_UCXX = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                              reason="ucxx not installed (bench/gpu_wheels.sh: carry the wheels)")
CUDA_TRANSPORTS = ["cuda_ipc", pytest.param("ucx", marks=_NO_UCXX),
                   pytest.param("auto", marks=_NO_UCXX)]
TWO_WRITES = [{"xfer": "r1", "gen": 1, "src": [[[0]], [[1]]], "dst": [[[5]], [[9]]],
               "checksum": True}]


def _peer(config: Any, plan: list[dict[str, Any]], address: str, blocks: int = SRC_BLOCKS,
          **extra: Any) -> PeerProcess:
    return PeerProcess(spec("sender", config, LAYOUT_BF16, blocks, plan, address=address,
                            device="cuda", **extra))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", CUDA_TRANSPORTS)
def test_round_trip_bit_exact_on_the_gpu(transport: str) -> None:
    async def main() -> None:
        config = fast_config(transport)
        receiver = await start_receiver(config, LAYOUT_BF16, 128, device="cuda")
        plan = make_plan(LAYOUT_BF16, seed=11)
        futures = [receiver.expect(t["xfer"], [Region(*e) for e in t["expect"]], t["gen"])
                   for t in plan]
        peer = await _peer(config, plan, receiver.address()).start()
        try:
            assert (await peer.line(60))["ready"]
            results = await peer.lines(N_XFERS, 60)  # all 20 in flight at once
            await asyncio.wait_for(asyncio.gather(*futures), 30)
            assert all(r["ok"] for r in results), results
            assert await peer.wait() == 0
            torch.cuda.synchronize()
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
        finally:
            await peer.aclose()
            await receiver.close()

    asyncio.run(main())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", CUDA_TRANSPORTS)
def test_wrong_token_late_write_and_killed_sender_on_the_gpu(transport: str) -> None:
    async def main() -> None:
        config = fast_config(transport, lease_s=20.0)
        receiver = await start_receiver(config, LAYOUT_BF16, 16, device="cuda")
        try:
            # A wrong token: refused, nothing mapped, nothing written.
            bad = _peer(fast_config(transport, token="nope"), TWO_WRITES, receiver.address(), 4)
            await bad.start()
            assert (await bad.line(60))["kind"] == "auth"
            await bad.aclose()
            # A late write after an abort: dropped; the blocks' new owner is untouched.
            first = receiver.expect("r1", [Region(5), Region(9)], 1)
            receiver.cancel("r1", "aborted")
            with pytest.raises(TransferCancelled):
                await first
            reused = receiver.expect("r1", [Region(5), Region(9)], 2)
            late = _peer(config, TWO_WRITES, receiver.address(), 4)
            await late.start()
            assert (await late.line(60))["ready"]
            assert (await late.line(60))["kind"] == "cancelled"
            await late.aclose()
            torch.cuda.synchronize()
            assert not receiver.kv.tensor.any() and not reused.done()
            receiver.cancel("r1")
            # A sender killed mid-transfer: a typed error within the deadline.
            future = receiver.expect("r2", [Region(5), Region(9)], 1)
            plan = [{**TWO_WRITES[0], "xfer": "r2"}]
            killed = _peer(config, plan, receiver.address(), 4, stop_after_first_write=True)
            await killed.start()
            assert (await killed.line(60))["ready"]
            assert (await killed.line(60))["stopping"]
            killed.kill()
            t0 = time.monotonic()
            with pytest.raises((PeerUnavailable, TransferTimeout)):
                await asyncio.wait_for(future, 15)
            assert time.monotonic() - t0 < 15
            await killed.aclose()
        finally:
            await receiver.close()
        # Nothing left mapped or allocated by the transports in this process.
        torch.cuda.synchronize()

    record()
    before = torch.cuda.memory_allocated()
    asyncio.run(main())
    # The killed sender never let go of its mapping: the receiver's cache is freed all
    # the same (torch keeps a storage it shared until every consumer has let go).
    gc.collect()  # the receiver and its futures may sit in reference cycles
    assert torch.cuda.memory_allocated() <= before, holders()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", CUDA_TRANSPORTS)
def test_copy_waits_on_its_chunk_only_and_close_leaves_nothing(transport: str) -> None:
    """The sender queues 3 s of later compute after the chunk's `ready` event (the next
    chunk's forward); the copy must not wait for it (cuda_ipc orders its copy stream by
    the event; ucx waits for the event on the host, and UCX's own copy streams may still
    serialize behind the compute: reported, asserted for cuda_ipc only). After close()
    the sender, still alive, holds no device memory, and the receiver's cache is freed
    in full: no consumer keeps its IPC export open."""
    plan = [{"xfer": "c", "gen": 1, "src": [[[0], [1]]], "dst": [[[5], [9]]],
             "overlap_s": 3.0}]
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    record()
    before = torch.cuda.memory_allocated()

    async def main() -> None:
        config = fast_config(transport, io_timeout_s=20.0)
        receiver = await start_receiver(config, LAYOUT_BF16, 16, device="cuda")
        future = receiver.expect("c", [Region(5), Region(9)], 1)
        peer = await _peer(config, plan, receiver.address(), 4, hold_after_close=True).start()
        try:
            assert (await peer.line(60))["ready"]
            result = await peer.line(60)
            assert result["ok"], result
            if transport == "cuda_ipc":
                assert result["overlapped"], "the copy waited for compute queued after it"
            await asyncio.wait_for(future, 10)
            got, src = receiver.kv.tensor.cpu(), make_kv(LAYOUT_BF16, 4, 1234)
            for s, d in ((0, 5), (1, 9)):
                assert torch.equal(got[d].view(torch.int16), src[s].view(torch.int16))
            closed = await peer.line(60)
            assert closed["closed"] and closed["allocated"] == 0, closed
            await receiver.close()
            del receiver, got
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()  # drops the export records consumers let go of
            assert torch.cuda.memory_allocated() <= before, \
                f"an IPC export is still held:\n{holders()}"
        finally:
            await peer.aclose()

    asyncio.run(main())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", CUDA_TRANSPORTS)
def test_killed_receiver_is_a_typed_error_on_the_gpu(transport: str) -> None:
    async def main() -> None:
        config = fast_config(transport)
        plan = [{"xfer": "k", "gen": 1, "dst": [[5], [9]]}]
        receiver = await PeerProcess(spec("receiver", config, LAYOUT_BF16, 16, plan,
                                          device="cuda")).start()
        sender = make_sender(config)
        sender.register(make_kv(LAYOUT_BF16, 4, 1).to("cuda"), LAYOUT_BF16)
        try:
            address = (await receiver.line(60))["address"]
            peer = await sender.connect(address)
            receiver.kill()
            await receiver.aclose()
            t0 = time.monotonic()
            with pytest.raises((PeerUnavailable, TransferTimeout)):
                await sender.write(peer, whole_blocks([0, 1]), whole_blocks([5, 9]), "k", 1)
                await sender.finish(peer, "k", 1)
            assert time.monotonic() - t0 < 15
        finally:
            await asyncio.wait_for(sender.close(), 15)
            await receiver.aclose()

    asyncio.run(main())


def _cluster_generate(tmp_path: Any, transport: str, prompts: list[list[int]],
                      max_tokens: list[int]) -> tuple[list[list[int]], float]:
    from tests.integration.disagg_util import child, start_cluster
    from tests.integration.serving_util import grpc_generate, metric

    cluster = start_cluster(tmp_path / transport, transport,
                            ("--device", "cuda", "--dtype", "float32"))
    try:
        got = asyncio.run(grpc_generate(f"127.0.0.1:{cluster.grpc_port}", prompts,
                                        max_tokens))
        port = int(child(cluster, "decode-0").extra["metrics_port"])
        return got, metric(port, "splitserve:remote_prefill_total", outcome="ok")
    finally:
        cluster.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["cuda_ipc", pytest.param("ucx", marks=_NO_UCXX)])
def test_1p1d_on_one_gpu_equals_a_colocated_worker(tmp_path: Any, transport: str) -> None:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from tests.factories import tiny_model_dir
    from tests.integration.disagg_util import NUM_BLOCKS, mixed_prompts

    prompts, max_tokens = mixed_prompts()
    colocated = LLM(tiny_model_dir("llama"), dtype="float32", device="cuda",
                    num_blocks=NUM_BLOCKS, max_num_seqs=32, max_num_batched_tokens=64)
    want = [o.token_ids for o in colocated.generate(
        prompts, [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens])]
    del colocated
    os.makedirs(tmp_path / transport, exist_ok=True)
    got, remote = _cluster_generate(tmp_path, transport, prompts, max_tokens)
    assert got == want
    assert remote == len(prompts)  # every prompt prefilled remotely
