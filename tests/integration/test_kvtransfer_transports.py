"""Bit-exact round trips for every transport, sender and receiver in two processes; the
handshake's refusals (a wrong token or layout), sender and receiver in one."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import random
import weakref
from typing import Any

import pytest
import torch

from kvtransfer import AuthError, KVLayout, KVTransferError, LayoutMismatch, make_sender
from tests.integration.kvtransfer_util import (
    LAYOUT_BF16,
    LAYOUT_F32,
    LAYOUT_FP8,
    LAYOUT_MLA,
    PeerProcess,
    fast_config,
    make_kv,
    open_sockets,
    shm_segments,
    spec,
    start_receiver,
)

NO_UCX = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                            reason="ucxx not installed")
TRANSPORTS = [
    "tcp",
    "shm",
    "cuda_ipc",  # host caches here: the same protocol with the host mover
    pytest.param("ucx", marks=NO_UCX),
]
LAYOUTS = {"f32": LAYOUT_F32, "bf16": LAYOUT_BF16, "fp8": LAYOUT_FP8, "mla": LAYOUT_MLA}
# Every layout over every transport; tcp's f32, bf16 and fp8 round trips are those of
# test_fp8_blocks_move_half_the_bytes_of_bf16_over_tcp (the same checks, and their bytes).
ROUND_TRIPS = [pytest.param(t, layout, id=f"{name}-{t}", marks=NO_UCX if t == "ucx" else ())
               for name, layout in LAYOUTS.items() for t in ("tcp", "shm", "cuda_ipc", "ucx")
               if t != "tcp" or name == "mla"]
SRC_BLOCKS, DST_BLOCKS, N_XFERS = 64, 128, 20


@pytest.fixture
def no_leaks(request):
    # After a peer died, UCX may keep its worker's TCP listeners until process exit
    # (a UCX-internal reference); for ucx we count every socket but those.
    ucx = "ucx" in request.node.name
    sockets, segments = open_sockets(ucx), shm_segments()
    yield
    gc.collect()  # UCX's worker (and its sockets) go with the last Python reference
    assert open_sockets(ucx) <= sockets, "a socket was left open"
    assert shm_segments() <= segments, "a shared-memory segment was left behind"


def make_plan(layout: KVLayout, seed: int) -> list[dict[str, Any]]:
    """20 transfers, scattered destinations, a mix of streaming shapes:

    i % 4 == 0: layer by layer (one write per layer)      -> partial-layer regions
    i % 4 == 1: whole blocks into a consecutive run       -> coalesced on the wire
    i % 4 == 2: whole blocks, scattered, one write
    i % 4 == 3: only layers [1, 3) of each block            -> partial transfer
    """
    rng = random.Random(seed)
    scattered = rng.sample(range(80), 60)
    plan = []
    for i in range(N_XFERS):
        src = list(range(3 * i, 3 * i + 3))
        dst = list(range(80 + 3 * (i // 4), 83 + 3 * (i // 4))) if i % 4 == 1 \
            else scattered[3 * i:3 * i + 3]
        if i % 4 == 0:
            writes = [([[s, k, k + 1] for s in src], [[d, k, k + 1] for d in dst])
                      for k in range(layout.num_layers)]
        elif i % 4 == 3:
            writes = [([[s, 1, 3] for s in src], [[d, 1, 3] for d in dst])]
        else:
            writes = [([[s] for s in src], [[d] for d in dst])]
        expect = [[d, 1, 3] for d in dst] if i % 4 == 3 else [[d] for d in dst]
        plan.append({"xfer": f"req-{i}", "gen": 1, "src": [w[0] for w in writes],
                     "dst": [w[1] for w in writes], "expect": expect,
                     "checksum": i % 2 == 0})
    return plan


def check_bit_exact(kv: torch.Tensor, src: torch.Tensor, plan: list[dict[str, Any]]) -> None:
    touched = torch.zeros(kv.shape[:2], dtype=torch.bool)
    for t in plan:
        for src_regions, dst_regions in zip(t["src"], t["dst"], strict=True):
            for s, d in zip(src_regions, dst_regions, strict=True):
                ls, le = (s[1], s[2]) if len(s) > 1 else (0, kv.shape[1])
                got = kv[d[0], ls:le].view(torch.uint8) if kv.dtype != torch.bfloat16 \
                    else kv[d[0], ls:le].view(torch.int16)
                want = src[s[0], ls:le].view(got.dtype)
                assert torch.equal(got, want), f"{t['xfer']}: block {d[0]} differs"
                touched[d[0], ls:le] = True
    assert not kv[~touched].any(), "bytes landed outside the destination regions"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("transport", "layout"), ROUND_TRIPS)
def test_round_trip_bit_exact(transport: str, layout: KVLayout, no_leaks: None) -> None:
    """Bit-exact for every layout; the first layout of each transport's runs with its
    sender in a fresh interpreter, whose exit code covers the interpreter's teardown
    (atexit handlers, finalizers at shutdown) as a worker's does."""
    first = next(p.values[1] for p in ROUND_TRIPS if p.values[0] == transport)
    asyncio.run(round_trip(transport, layout, fresh=layout is first))


async def round_trip(transport: str, layout: KVLayout, fresh: bool = False) -> float:
    """The plan's transfers sent and checked bit-exact; returns the bytes moved. `fresh`:
    the sender is a new interpreter, not a fork of the forkserver."""
    config = fast_config(transport)
    receiver = await start_receiver(config, layout, DST_BLOCKS)
    plan = make_plan(layout, seed=7)
    futures = [receiver.expect(t["xfer"], [_r(e) for e in t["expect"]], t["gen"])
               for t in plan]
    peer = await PeerProcess(spec("sender", config, layout, SRC_BLOCKS, plan,
                                  address=receiver.address()), fresh=fresh).start()
    try:
        assert (await peer.line())["ready"]
        sender_side = await peer.lines(N_XFERS)  # all in flight at once on the sender
        await asyncio.wait_for(asyncio.gather(*futures), 30)
        assert all(r["ok"] for r in sender_side), sender_side
        assert await peer.wait() == 0
        check_bit_exact(receiver.kv.tensor, make_kv(layout, SRC_BLOCKS, 1234), plan)
        want = sum(len(t["expect"]) for t in plan) * layout.block_bytes
        got = receiver.metrics.value("splitserve:kv_transfer_bytes_total")
        assert got <= want and got > 0.6 * want  # partial-layer transfers move less
        receiver.table.check_integrity()
        return float(got)
    finally:
        await peer.aclose()
        await receiver.close()


@pytest.mark.timeout(90)
def test_fp8_blocks_move_half_the_bytes_of_bf16_over_tcp(no_leaks: None) -> None:
    """The same transfers of an FP8 cache move half the bytes of bfloat16 and a
    quarter of float32 (one byte a value), bit-exact."""
    async def main() -> None:
        moved = {lay.dtype: await round_trip("tcp", lay)
                 for lay in (LAYOUT_F32, LAYOUT_BF16, LAYOUT_FP8)}
        assert moved["float8_e4m3fn"] * 2 == moved["bfloat16"]
        assert moved["float8_e4m3fn"] * 4 == moved["float32"]
        assert LAYOUT_FP8.token_bytes * 2 == LAYOUT_BF16.token_bytes

    asyncio.run(main())


async def refusal(receiver: Any, config: Any, layout: KVLayout) -> KVTransferError:
    """What a sender with `config` and a `layout` cache (here: the handshake, over a
    real socket, is what is refused) gets when it connects to `receiver`."""
    sender = make_sender(config)
    sender.register(make_kv(layout, 4, seed=1), layout)
    try:
        with pytest.raises(KVTransferError) as refused:
            await sender.connect(receiver.address())
        return refused.value
    finally:
        await sender.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_wrong_token_and_layout_are_refused(transport: str, no_leaks: None) -> None:
    async def main() -> None:
        config = fast_config(transport)
        receiver = await start_receiver(config, LAYOUT_F32, 16)
        future = receiver.expect("x", [_r([0])], 1)
        bad_token = fast_config(transport, token="not-the-token")
        try:
            auth = await refusal(receiver, bad_token, LAYOUT_F32)
            layout = await refusal(receiver, config, LAYOUT_BF16)
            assert isinstance(auth, AuthError) and isinstance(layout, LayoutMismatch)
            assert "dtype" in str(layout)
            m = receiver.metrics
            assert m.value("splitserve:kv_transfer_handshakes_refused_total",
                           reason="auth") == 1
            assert m.value("splitserve:kv_transfer_handshakes_refused_total",
                           reason="layout") == 1
            assert not future.done() and not receiver.kv.tensor.any()
        finally:
            await receiver.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t != "shm"])
def test_close_lets_go_of_the_cache(transport: str, no_leaks: None) -> None:
    """What still refers to a closed receiver or sender (here the traceback of a failed
    transfer and the objects themselves) does not keep the engine's KV tensor alive: on
    the GPU such references held a closed receiver's cache (tests/gpu).
    (shm's cache is the transport's own shared memory, freed by close.)"""
    from kvtransfer import TransferCancelled

    async def main() -> tuple[Any, Any, BaseException, list[weakref.ref[Any]]]:
        config = fast_config(transport)
        receiver = await start_receiver(config, LAYOUT_F32, 16)
        sender = make_sender(config)
        sender.register(make_kv(LAYOUT_F32, 8, seed=1), LAYOUT_F32)
        caches = [weakref.ref(receiver.kv.tensor), weakref.ref(sender.kv.tensor)]
        future = receiver.expect("x", [_r([0])], 1)
        receiver.cancel("x", "aborted")
        with pytest.raises(TransferCancelled) as failed:
            await future
        await receiver.close()
        await sender.close()
        return receiver, sender, failed.value, caches

    receiver, sender, error, caches = asyncio.run(main())
    assert error.__traceback__ is not None  # its frames refer to the receiver
    gc.collect()
    assert receiver.kv is None and sender.kv is None
    assert [ref() for ref in caches] == [None, None], "a closed transport keeps its cache"


def _r(item: list[int]) -> Any:
    from kvtransfer import Region
    return Region(*item)


# 3 KiB blocks: 401 contiguous ones coalesce into one 1.2 MB region, which ucx cuts
# into one part per receiver lane (parts of unequal, page-rounded sizes).
LAYOUT_3K = KVLayout(num_layers=4, num_kv_heads=2, head_dim=12, block_size=8,
                     dtype="bfloat16")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_large_regions_bit_exact(transport: str, no_leaks: None) -> None:
    n = 401
    plan = [{"xfer": "big", "gen": 1, "src": [[[s] for s in range(n)]],
             "dst": [[[450 + s] for s in range(n)]], "checksum": False},
            {"xfer": "big-csum", "gen": 1, "src": [[[10 + s] for s in range(n)]],
             "dst": [[[s] for s in range(n)]], "checksum": True}]

    async def main() -> None:
        config = fast_config(transport)
        receiver = await start_receiver(config, LAYOUT_3K, 900)
        futures = [receiver.expect(t["xfer"], [_r(d) for d in t["dst"][0]], 1) for t in plan]
        peer = await PeerProcess(spec("sender", config, LAYOUT_3K, n + 10, plan,
                                      address=receiver.address())).start()
        try:
            assert (await peer.line())["ready"]
            assert all(r["ok"] for r in await peer.lines(len(plan)))
            await asyncio.wait_for(asyncio.gather(*futures), 30)
            assert await peer.wait() == 0
            check_bit_exact(receiver.kv.tensor, make_kv(LAYOUT_3K, n + 10, 1234), plan)
            receiver.table.check_integrity()
        finally:
            await peer.aclose()
            await receiver.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_fp8_and_bf16_peers_are_refused(transport: str, no_leaks: None) -> None:
    """A prefill with an FP8 cache and a decode with a bfloat16 one disagree on the KV
    dtype: the handshake refuses them, naming it, and nothing lands."""
    async def main() -> None:
        config = fast_config(transport)
        receiver = await start_receiver(config, LAYOUT_BF16, 16)
        future = receiver.expect("x", [_r([0])], 1)
        try:
            refused = await refusal(receiver, config, LAYOUT_FP8)
            assert isinstance(refused, LayoutMismatch)
            assert "float8_e4m3fn" in str(refused) and "bfloat16" in str(refused)
            assert not future.done() and not receiver.kv.tensor.any()
        finally:
            await receiver.close()

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_latent_and_kv_layouts_of_equal_size_are_refused(transport: str,
                                                         no_leaks: None) -> None:
    """A prefill with K/V blocks and a decode with MLA latent blocks of the same byte
    size disagree on the layout: the handshake refuses them by name."""
    assert LAYOUT_MLA.block_bytes == LAYOUT_F32.block_bytes

    async def main() -> None:
        config = fast_config(transport)
        receiver = await start_receiver(config, LAYOUT_MLA, 16)
        future = receiver.expect("x", [_r([0])], 1)
        try:
            refused = await refusal(receiver, config, LAYOUT_F32)
            assert isinstance(refused, LayoutMismatch)
            assert "mla_latent_v1" in str(refused)
            assert receiver.metrics.value("splitserve:kv_transfer_handshakes_refused_total",
                                          reason="layout") == 1
            assert not future.done() and not receiver.kv.tensor.any()
        finally:
            await receiver.close()

    asyncio.run(main())
