"""Bit-exact round trips for every transport, sender and receiver in two processes; the
handshake's refusals (a wrong token or layout), sender and receiver in one."""

from __future__ import annotations

import asyncio
import gc
import random
import weakref
from typing import Any

import pytest

from kvtransfer import (
    AuthError,
    KVLayout,
    KVTransferError,
    LayoutMismatch,
    TransferConfig,
    make_sender,
)
from tests.integration.kvtransfer_util import (
    LAYOUT_BF16,
    LAYOUT_F32,
    LAYOUT_FP8,
    LAYOUT_MLA,
    NO_UCX,
    TRANSPORTS,
    fast_config,
    make_kv,
    plan_lands,
    receiving,
    sender_child,
    start_receiver,
    start_sender,
)

pytestmark = pytest.mark.usefixtures("no_leaks")
LAYOUTS = {"f32": LAYOUT_F32, "bf16": LAYOUT_BF16, "fp8": LAYOUT_FP8, "mla": LAYOUT_MLA}
# Every layout over every transport; tcp's f32, bf16 and fp8 round trips are those of
# test_fp8_blocks_move_half_the_bytes_of_bf16_over_tcp (the same checks, and their bytes).
ROUND_TRIPS = [pytest.param(t, layout, id=f"{name}-{t}", marks=NO_UCX if t == "ucx" else ())
               for name, layout in LAYOUTS.items() for t in ("tcp", "shm", "cuda_ipc", "ucx")
               if t != "tcp" or name == "mla"]
SRC_BLOCKS, DST_BLOCKS, N_XFERS = 64, 128, 20


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("transport", "layout"), ROUND_TRIPS)
def test_round_trip_bit_exact(transport: str, layout: KVLayout) -> None:
    """Bit-exact for every layout; the first layout of each transport's runs with its
    sender in a fresh interpreter, whose exit code covers the interpreter's teardown
    (atexit handlers, finalizers at shutdown) as a worker's does."""
    first = next(p.values[1] for p in ROUND_TRIPS if p.values[0] == transport)
    asyncio.run(round_trip(transport, layout, fresh=layout is first))


async def round_trip(transport: str, layout: KVLayout, fresh: bool = False) -> float:
    """The plan's transfers sent and checked bit-exact; returns the bytes moved. `fresh`:
    the sender is a new interpreter, not a fork of the forkserver."""
    plan = make_plan(layout, seed=7)
    async with sender_child(fast_config(transport), layout, DST_BLOCKS, SRC_BLOCKS, plan,
                            fresh=fresh) as (receiver, peer):
        futures = [receiver.expect(t["xfer"], [_r(e) for e in t["expect"]], t["gen"])
                   for t in plan]
        await plan_lands(receiver, peer, plan, futures, SRC_BLOCKS)
        want = sum(len(t["expect"]) for t in plan) * layout.block_bytes
        got = receiver.metrics.value("splitserve:kv_transfer_bytes_total")
        assert got <= want and got > 0.6 * want  # partial-layer transfers move less
        return float(got)


@pytest.mark.timeout(90)
def test_fp8_blocks_move_half_the_bytes_of_bf16_over_tcp() -> None:
    """The same transfers of an FP8 cache move half the bytes of bfloat16 and a
    quarter of float32 (one byte a value), bit-exact."""
    async def main() -> None:
        moved = {lay.dtype: await round_trip("tcp", lay)
                 for lay in (LAYOUT_F32, LAYOUT_BF16, LAYOUT_FP8)}
        assert moved["float8_e4m3fn"] * 2 == moved["bfloat16"]
        assert moved["float8_e4m3fn"] * 4 == moved["float32"]
        assert LAYOUT_FP8.token_bytes * 2 == LAYOUT_BF16.token_bytes

    asyncio.run(main())


async def refused(config: TransferConfig, layout: KVLayout,
                  *senders: tuple[TransferConfig, KVLayout]) -> tuple[list[Any], Any]:
    """What senders of (config, cache layout) get, in turn, connecting to a receiver of
    `config` and a `layout` cache (the handshake, over a real socket, is what is
    refused): their errors, and the receiver's metrics. Checks that nothing landed and
    a transfer expected meanwhile still waits."""
    async with receiving(config, layout, 16) as receiver:
        future = receiver.expect("x", [_r([0])], 1)
        errors = []
        for sender_config, sender_layout in senders:
            sender = make_sender(sender_config)
            sender.register(make_kv(sender_layout, 4, seed=1), sender_layout)
            try:
                with pytest.raises(KVTransferError) as refusal:
                    await sender.connect(receiver.address())
                errors.append(refusal.value)
            finally:
                await sender.close()
        assert not future.done() and not receiver.kv.tensor.any()
        return errors, receiver.metrics


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_wrong_token_and_layout_are_refused(transport: str) -> None:
    async def main() -> None:
        config = fast_config(transport)
        bad_token = fast_config(transport, token="not-the-token")
        (auth, layout), m = await refused(config, LAYOUT_F32, (bad_token, LAYOUT_F32),
                                          (config, LAYOUT_BF16))
        assert isinstance(auth, AuthError) and isinstance(layout, LayoutMismatch)
        assert "dtype" in str(layout)
        assert m.value("splitserve:kv_transfer_handshakes_refused_total", reason="auth") == 1
        assert m.value("splitserve:kv_transfer_handshakes_refused_total", reason="layout") == 1

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t != "shm"])
def test_close_lets_go_of_the_cache(transport: str) -> None:
    """What still refers to a closed receiver or sender (here the traceback of a failed
    transfer and the objects themselves) does not keep the engine's KV tensor alive: on
    the GPU such references held a closed receiver's cache (tests/gpu).
    (shm's cache is the transport's own shared memory, freed by close.)"""
    from kvtransfer import TransferCancelled

    async def main() -> tuple[Any, Any, BaseException, list[weakref.ref[Any]]]:
        config = fast_config(transport)
        receiver = await start_receiver(config, LAYOUT_F32, 16)
        sender = start_sender(config, LAYOUT_F32, 8, seed=1)
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
def test_large_regions_bit_exact(transport: str) -> None:
    n = 401
    plan = [{"xfer": "big", "gen": 1, "src": [[[s] for s in range(n)]],
             "dst": [[[450 + s] for s in range(n)]], "checksum": False},
            {"xfer": "big-csum", "gen": 1, "src": [[[10 + s] for s in range(n)]],
             "dst": [[[s] for s in range(n)]], "checksum": True}]

    async def main() -> None:
        async with sender_child(fast_config(transport), LAYOUT_3K, 900, n + 10,
                                plan) as (receiver, peer):
            futures = [receiver.expect(t["xfer"], [_r(d) for d in t["dst"][0]], 1)
                       for t in plan]
            await plan_lands(receiver, peer, plan, futures, n + 10)

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_fp8_and_bf16_peers_are_refused(transport: str) -> None:
    """A prefill with an FP8 cache and a decode with a bfloat16 one disagree on the KV
    dtype: the handshake refuses them, naming it, and nothing lands."""
    async def main() -> None:
        config = fast_config(transport)
        (error,), _ = await refused(config, LAYOUT_BF16, (config, LAYOUT_FP8))
        assert isinstance(error, LayoutMismatch)
        assert "float8_e4m3fn" in str(error) and "bfloat16" in str(error)

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_latent_and_kv_layouts_of_equal_size_are_refused(transport: str) -> None:
    """A prefill with K/V blocks and a decode with MLA latent blocks of the same byte
    size disagree on the layout: the handshake refuses them by name."""
    assert LAYOUT_MLA.block_bytes == LAYOUT_F32.block_bytes

    async def main() -> None:
        config = fast_config(transport)
        (error,), m = await refused(config, LAYOUT_MLA, (config, LAYOUT_F32))
        assert isinstance(error, LayoutMismatch)
        assert "mla_latent_v1" in str(error)
        assert m.value("splitserve:kv_transfer_handshakes_refused_total", reason="layout") == 1

    asyncio.run(main())
