"""The block copy kernel (kvtransfer/copy_kernel.py) compiled for CUDA against the torch
copy (skipped without a GPU): a Llama-3-8B-shaped bf16 cache (2 MiB blocks, 16-byte
vectors), FP8 bytes, the MLA latent layout and 15-byte layers (byte words), scattered
ids, a layer range, per-layer tensors against a block-major cache, and a copy on a side
stream ordered after an event only."""

from __future__ import annotations

import random

import pytest
import torch

from kvtransfer import KVLayout
from kvtransfer.copy_kernel import (
    BlockCopy,
    copy_blocks_reference,
    gather_blocks,
    layer_views,
    scatter_blocks,
)
from kvtransfer.memory import torch_dtype

pytestmark = pytest.mark.gpu

LAYOUTS = {
    "llama3-8b": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                          dtype="bfloat16"),
    "fp8": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                    dtype="float8_e4m3fn"),
    "mla": KVLayout(num_layers=27, num_kv_heads=1, head_dim=576, block_size=16,
                    dtype="bfloat16", name="mla_latent_v1"),
    "odd": KVLayout(num_layers=3, num_kv_heads=1, head_dim=5, block_size=3,
                    dtype="float8_e4m3fn", name="mla_latent_v1"),
}
WORDS = {"llama3-8b": (8, 16), "fp8": (8, 16), "mla": (8, 16), "odd": (1, 1)}


def cache(layout: KVLayout, blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.empty(layout.tensor_shape(blocks), dtype=torch_dtype(layout), device="cuda")
    b = t.view(-1).view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device="cuda", generator=g))
    return t


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("count", [1, 37])
def test_kernel_equals_the_torch_copy_on_cuda(name: str, count: int) -> None:
    layout = LAYOUTS[name]
    rng = random.Random(count)
    src, dst = cache(layout, 48, 1), cache(layout, 64, 2)
    ref = dst.clone()
    src_ids, dst_ids = rng.sample(range(48), count), rng.sample(range(64), count)
    copy = BlockCopy(layer_views(src, layout), layer_views(dst, layout))
    assert (copy.word, copy.align) == WORDS[name]
    copy(src_ids, dst_ids)
    copy(src_ids[:3], dst_ids[:3], (1, 3))  # a layer range: the same bytes again
    copy_blocks_reference(layer_views(src, layout), layer_views(ref, layout), src_ids, dst_ids)
    torch.cuda.synchronize()
    assert torch.equal(as_bytes(dst), as_bytes(ref))


def test_per_layer_tensors_gather_and_scatter_on_cuda() -> None:
    layout = LAYOUTS["fp8"]
    pool = cache(layout, 40, 3)
    ids = random.Random(4).sample(range(40), 13)
    layers = [torch.zeros(16, layout.layer_bytes, dtype=torch.uint8, device="cuda")
              for _ in range(layout.num_layers)]
    BlockCopy(layer_views(pool, layout), layers)(ids, range(13))
    staging = torch.zeros(layout.tensor_shape(16), dtype=pool.dtype, device="cuda")
    gather_blocks(pool, ids, staging, layout)
    back = torch.zeros_like(pool)
    scatter_blocks(staging, back, ids, layout)
    torch.cuda.synchronize()
    for i, layer in enumerate(layers):
        assert torch.equal(layer[:13], as_bytes(pool[ids, i]).view(13, -1))
    assert torch.equal(as_bytes(staging[:13]), as_bytes(pool[ids]))
    assert torch.equal(as_bytes(back[ids]), as_bytes(pool[ids]))
    assert not as_bytes(back[[b for b in range(40) if b not in ids]]).any()


def test_a_copy_on_a_side_stream_waits_for_its_event_only() -> None:
    """The cuda_ipc launch: ids up from pinned memory, the copy stream waits on the
    chunk's event; the bytes written before the event are the ones copied."""
    layout = LAYOUTS["llama3-8b"]
    src, dst = cache(layout, 8, 5), torch.zeros(layout.tensor_shape(8), dtype=torch.bfloat16,
                                                 device="cuda")
    copy = BlockCopy(layer_views(src, layout), layer_views(dst, layout))
    compute, side = torch.cuda.current_stream(), torch.cuda.Stream()
    torch.cuda._sleep(50_000_000)  # the "forward" still running when the copy is queued
    src[3].fill_(7)
    ready = torch.cuda.Event()
    ready.record(compute)
    with torch.cuda.stream(side):
        copy([3], [6], after=ready)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    assert torch.equal(as_bytes(dst[6]), as_bytes(src[3]))
    assert (dst[6] == 7).all()


def test_staged_regions_bring_a_cuda_caches_regions_to_the_host() -> None:
    """What tcp and shm send from a CUDA cache: one gather and one copy to the host per
    batch of blocks of one layer range."""
    from kvtransfer import Region
    from kvtransfer.copy_kernel import staged_regions

    layout = LAYOUTS["llama3-8b"]
    pool = cache(layout, 24, 6)
    regions = [Region(9), Region(2, 0, None, 4), Region(0), Region(5, 1, 3), Region(7, 1, 3),
               Region(12), Region(20, 30, 32)]
    got = list(staged_regions(pool, layout, regions, limit=3 * layout.block_bytes))
    flat = as_bytes(pool).cpu()
    for r, data in zip(regions, got, strict=True):
        off, n = r.resolve(layout, 24)
        assert data.device.type == "cpu" and torch.equal(data, flat[off:off + n])
