"""The block copy kernel (kvtransfer/copy_kernel.py) against the torch reference, under
Triton's interpreter without a GPU (tests/conftest.py sets TRITON_INTERPRET): scattered
and non-contiguous block ids, odd counts, every layer or a layer range, float32 /
bfloat16 / FP8 bytes and the MLA latent layout; the staging gather and scatter; and
the cuda_ipc sender's pieces that pick it (`Mapped`) or defer its notice (the host
mover's copy is a `Ready`). tests/gpu/test_copy_kernel_cuda.py runs it on CUDA."""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvtransfer import KVLayout, Region
from kvtransfer.copy_kernel import (
    BlockCopy,
    copy_blocks_reference,
    gather_blocks,
    layer_views,
    plan_blocks,
    scatter_blocks,
)
from kvtransfer.cuda_ipc import HostMover, Mapped
from kvtransfer.memory import RegisteredKV, torch_dtype
from tests.integration.kvtransfer_util import LAYOUT_BF16, LAYOUT_F32, LAYOUT_FP8, LAYOUT_MLA

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1"
                                and not torch.cuda.is_available(),
                                reason="the kernel needs CUDA or Triton's interpreter")

LAYOUT_MLA_BF16 = KVLayout(num_layers=3, num_kv_heads=1, head_dim=24, block_size=4,
                           dtype="bfloat16", name="mla_latent_v1")
# 15-byte layers: no word wider than a byte divides them
LAYOUT_ODD = KVLayout(num_layers=3, num_kv_heads=1, head_dim=5, block_size=3,
                      dtype="float8_e4m3fn", name="mla_latent_v1")
CASES = {"f32": (LAYOUT_F32, 8), "bf16": (LAYOUT_BF16, 8), "fp8": (LAYOUT_FP8, 8),
         "mla": (LAYOUT_MLA, 8), "mla-bf16": (LAYOUT_MLA_BF16, 8), "odd-fp8": (LAYOUT_ODD, 1)}


def cache(layout: KVLayout, blocks: int, seed: int) -> torch.Tensor:
    """A cache with random bytes (every FP8 pattern, NaNs included: copies are bytes)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.empty(layout.tensor_shape(blocks), dtype=torch_dtype(layout))
    t.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (t.numel() * t.element_size(),),
                                                     dtype=torch.uint8, generator=g))
    return t


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("count", [1, 7, 12])
def test_kernel_equals_the_torch_copy(name: str, count: int) -> None:
    layout, word = CASES[name]
    rng = random.Random(count)
    src, dst = cache(layout, 16, 1), cache(layout, 24, 2)
    ref = dst.clone()
    # scattered over both pools, neither sorted nor contiguous
    src_ids, dst_ids = rng.sample(range(16), count), rng.sample(range(24), count)
    copy = BlockCopy(layer_views(src, layout), layer_views(dst, layout))
    assert copy.kernel and copy.word == word  # the kernel, not the reference, ran
    copy(src_ids, dst_ids)
    copy_blocks_reference(layer_views(src, layout), layer_views(ref, layout), src_ids, dst_ids)
    assert torch.equal(as_bytes(dst), as_bytes(ref))
    assert torch.equal(as_bytes(dst[dst_ids]), as_bytes(src[src_ids]))


def test_a_layer_range_copies_those_layers_only() -> None:
    layout = LAYOUT_BF16
    src, dst = cache(layout, 8, 3), cache(layout, 8, 4)
    before = dst.clone()
    BlockCopy(layer_views(src, layout), layer_views(dst, layout))([5, 0, 3], [1, 6, 2], (1, 3))
    for s, d in ((5, 1), (0, 6), (3, 2)):
        assert torch.equal(as_bytes(dst[d, 1:3]), as_bytes(src[s, 1:3]))
        assert torch.equal(as_bytes(dst[d, 0]), as_bytes(before[d, 0]))
        assert torch.equal(as_bytes(dst[d, 3]), as_bytes(before[d, 3]))
    untouched = [b for b in range(8) if b not in (1, 6, 2)]
    assert torch.equal(as_bytes(dst[untouched]), as_bytes(before[untouched]))


@pytest.mark.parametrize("layout", [LAYOUT_FP8, LAYOUT_MLA], ids=["fp8", "mla"])
@pytest.mark.parametrize("named", [True, False], ids=["layout", "shape"])
def test_staging_gather_then_scatter_round_trips(layout: KVLayout, named: bool) -> None:
    """With the layout, or with the block and layer counts read off the tensors' shape
    (how the engine calls it for tensor parallelism's staging copy)."""
    pool = cache(layout, 20, 5)
    ids = [17, 2, 9, 11, 0]
    staging = torch.zeros(layout.tensor_shape(8), dtype=pool.dtype)
    gather_blocks(pool, ids, staging, layout if named else None)
    assert torch.equal(as_bytes(staging[:5]), as_bytes(pool[ids]))
    assert not as_bytes(staging[5:]).any()
    back = torch.zeros_like(pool)
    scatter_blocks(staging, back, ids, layout if named else None)
    assert torch.equal(as_bytes(back[ids]), as_bytes(pool[ids]))
    others = [b for b in range(20) if b not in ids]
    assert not as_bytes(back[others]).any()


def test_plan_groups_blocks_by_layer_range_and_refuses_what_lies_outside() -> None:
    layout = LAYOUT_F32  # 4 layers
    pairs = [(Region(3, 0, None, 2), Region(10)), (Region(7), Region(1)),
             (Region(2, 1, 3), Region(5, 1, 3))]
    with pytest.raises(ValueError, match="differ in size"):
        plan_blocks(pairs, layout, 16, 16)
    pairs[0] = (Region(3, 0, None, 2), Region(10, 0, None, 2))
    assert plan_blocks(pairs, layout, 16, 16) == {(0, 4): ([3, 4, 7], [10, 11, 1]),
                                                  (1, 3): ([2], [5])}
    with pytest.raises(ValueError, match="outside"):
        plan_blocks([(Region(1), Region(16))], layout, 16, 16)
    with pytest.raises(ValueError, match="outside"):
        plan_blocks([(Region(16), Region(1))], layout, 16, 16)
    with pytest.raises(ValueError, match="bad layer range"):
        plan_blocks([(Region(1, 2, 9), Region(3, 2, 9))], layout, 16, 16)


@pytest.mark.parametrize("layout", [LAYOUT_BF16, LAYOUT_FP8, LAYOUT_MLA],
                         ids=["bf16", "fp8", "mla"])
def test_the_cuda_ipc_sender_copies_a_chunk_with_the_kernel(layout: KVLayout) -> None:
    """`Mapped` is what `CudaMover.open` returns over the peer's mapped cache and what
    each chunk's launch goes through: here over a host byte tensor."""
    src = cache(layout, 12, 6)
    peer = cache(layout, 20, 7)
    ref = peer.clone()
    mapped = Mapped(as_bytes(peer), RegisteredKV(src, layout))
    assert isinstance(mapped.copy, BlockCopy) and mapped.copy.kernel
    pairs = [(Region(2, 0, None, 3), Region(4, 0, None, 3)), (Region(9), Region(17)),
             (Region(0), Region(1))]
    mapped.launch(pairs)
    copy_blocks_reference(layer_views(src, layout), layer_views(ref, layout),
                          [2, 3, 4, 9, 0], [4, 5, 6, 17, 1])
    assert torch.equal(as_bytes(peer), as_bytes(ref))
    with pytest.raises(ValueError, match="outside"):
        mapped.launch([(Region(0), Region(20))])


def test_the_host_movers_copy_is_a_ready_that_completes_when_the_bytes_landed() -> None:
    import asyncio
    import time

    layout = LAYOUT_BF16
    src, dst = cache(layout, 6, 8), torch.zeros(layout.tensor_shape(6), dtype=torch.bfloat16)
    kv = RegisteredKV(src, layout)
    mover = HostMover(inline_bytes=0)  # on its copy thread (a small copy runs inline)
    target = mover.open({"pid": os.getpid(), "address": dst.data_ptr(),
                         "nbytes": as_bytes(dst).numel()}, kv)

    async def main() -> None:
        pairs = [(Region(4), Region(0)), (Region(1, 2, 4), Region(5, 2, 4))]
        copied = await mover.copy(kv, target, pairs, time.monotonic() + 30, None)
        assert copied is not None
        copied.synchronize()
        assert copied.query()

    asyncio.run(main())
    assert torch.equal(as_bytes(dst[0]), as_bytes(src[4]))
    assert torch.equal(as_bytes(dst[5, 2:4]), as_bytes(src[1, 2:4]))
    assert not as_bytes(dst[5, :2]).any() and not as_bytes(dst[1:5]).any()
    mover.close([target])


def test_per_layer_tensors_and_a_block_major_cache_copy_both_ways() -> None:
    """The pointer table takes any per-layer bases and one block stride per side: here
    one separate allocation per layer ([blocks, layer_bytes] each) against the
    block-major cache (stride block_bytes)."""
    layout = LAYOUT_FP8
    pool = cache(layout, 10, 9)
    layers = [torch.zeros(7, layout.layer_bytes, dtype=torch.uint8) for _ in range(4)]
    to_layers = BlockCopy(layer_views(pool, layout), layers)
    assert to_layers.strides == (layout.block_bytes // 8, layout.layer_bytes // 8)
    to_layers([8, 1, 4], [6, 0, 3])
    for i, layer in enumerate(layers):
        assert torch.equal(layer[[6, 0, 3]], as_bytes(pool[[8, 1, 4], i]).view(3, -1))
        assert not layer[[1, 2, 4, 5]].any()
    back = torch.zeros_like(pool)
    BlockCopy(layers, layer_views(back, layout))([6, 0, 3], [2, 9, 5])
    assert torch.equal(as_bytes(back[[2, 9, 5]]), as_bytes(pool[[8, 1, 4]]))
    assert not as_bytes(back[[0, 1, 3, 4, 6, 7, 8]]).any()


@pytest.mark.parametrize("limit", [1 << 20, 3 * LAYOUT_BF16.block_bytes])
def test_staged_regions_are_the_regions_bytes_in_order(limit: int) -> None:
    """What tcp and shm send from a CUDA cache: a batch of blocks per gather and copy,
    by layer range; a region past the limit as it lies (the small limit batches three
    blocks and takes the four-block region whole)."""
    from kvtransfer.copy_kernel import staged_regions

    layout = LAYOUT_BF16
    pool = cache(layout, 16, 10)
    regions = [Region(9), Region(2, 0, None, 4), Region(0), Region(5, 1, 3), Region(7, 1, 3),
               Region(12), Region(14), Region(15), Region(11, 2, 4)]
    got = list(staged_regions(pool, layout, regions, limit))
    assert len(got) == len(regions)
    for r, data in zip(regions, got, strict=True):
        off, n = r.resolve(layout, 16)
        assert torch.equal(data, as_bytes(pool)[off:off + n])
    with pytest.raises(ValueError, match="outside"):
        list(staged_regions(pool, layout, [Region(16)], limit))


# Compiled for Hopper (sm_90) in a fresh process without the interpreter (which, once a
# kernel ran under it in this process, may have left triton.language patched): the
# load and store instructions of the copy at two alignments, as a JSON line.
COMPILE = """
import collections, json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvtransfer.copy_kernel import _kernel

signature = {"ptrs": "*i64", "ids": "*i64", "n_pad": "i32", "num_layers": "i32",
             "first_layer": "i32", "src_stride": "i64", "dst_stride": "i64",
             "words": "i32", "WORD": "constexpr", "ALIGN": "constexpr", "TILE": "constexpr"}
attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 5, 6, 7)}
ops = {}
for align in (16, 8):
    src = ASTSource(fn=_kernel(), signature=signature, attrs=attrs,
                    constexprs={"WORD": 8, "ALIGN": align, "TILE": 4096})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    ops[align] = collections.Counter(re.findall(r"(?:ld|st)\\.global[.\\w]*", ptx))
print(json.dumps(ops))
"""


def test_the_kernel_compiles_to_16_byte_vector_loads_for_an_h100() -> None:
    """No GPU needed: Triton compiles for sm_90 here. With the specializations a launch
    gets for a Llama-shaped cache (strides and layer words divisible by 16), every load
    and store of the copy is a 16-byte vector (two 8-byte words a thread)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ops = {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}
    # 4096 words a program over 128 threads: 16 vectors of two words each way; the rest
    # of the loads are the program's ids and table entries
    assert ops[16]["ld.global.v2.b64"] == 16 and ops[16]["st.global.v2.b64"] == 16
    assert ops[16].get("st.global.b64", 0) == 0
    assert ops[8].get("ld.global.v2.b64", 0) == 0  # 8-byte aligned: one word a load
