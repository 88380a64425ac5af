"""Whole-block KV copies in one launch: blocks `src_ids` of one cache into blocks
`dst_ids` of another, over every layer, as raw words (bf16, float32 and FP8 caches are
the same bytes to it; so are K/V pairs and MLA latents).

A side is a list of per-layer byte views, each `[num_blocks, layer_bytes]` with one
block stride, so block b's layer l lies at

    base[l] + b * stride          (base: the per-layer pointer table)

A block-major cache (`kvtransfer/layout.py`) and a contiguous staging buffer are both
such a list (`layer_views`): base[l] = data_ptr + l * layer_bytes, stride = block_bytes;
so is a peer's cache mapped through CUDA IPC, or per-layer tensors of one device.

The kernel's grid is (block pair, layer, tile): one program copies one tile of one
layer of one block with loads as wide as the addresses allow (16-byte vectors when
every base, stride and size is 16-byte aligned). The pointer table goes up once per
pair of sides (`BlockCopy`); a launch uploads only the block ids.

Off CUDA the copy is the torch reference (`copy_blocks_reference`, one index copy per
layer) unless Triton's interpreter is on, which is how the CPU tests check the kernel.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvtransfer import region_rows as rr
from kvtransfer.layout import KVLayout, Pairs, Region

_MAX_TILE = 4096  # words per program: 32 KiB of int64, 16 vectors per thread (4 warps)
_STAGE_BYTES = 64 << 20  # device staging per gather for a host-bound copy


def _kernel():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl

    # n_pad and first_layer vary between chunks: not specialized, one variant serves all
    @triton.jit(do_not_specialize=["n_pad", "first_layer"])
    def copy_blocks_kernel(ptrs, ids, n_pad, num_layers, first_layer, src_stride,  # type: ignore[no-untyped-def]
                           dst_stride, words, WORD: tl.constexpr, ALIGN: tl.constexpr,
                           TILE: tl.constexpr):
        row = tl.program_id(0)
        layer = first_layer + tl.program_id(1)
        start = tl.program_id(2) * TILE
        s_id = tl.load(ids + row).to(tl.int64)
        d_id = tl.load(ids + n_pad + row).to(tl.int64)
        s_base = tl.load(ptrs + layer)
        d_base = tl.load(ptrs + num_layers + layer)
        if WORD == 8:
            kind = tl.int64
        elif WORD == 4:
            kind = tl.int32
        elif WORD == 2:
            kind = tl.int16
        else:
            kind = tl.uint8
        # The hints are what the host checked (`_alignment`): with them the compiler
        # issues ALIGN-byte vector loads and stores (16: two words of 8 a thread) off
        # addresses read from memory, which it cannot prove aligned itself.
        src = tl.multiple_of(s_base.to(tl.pointer_type(kind)) + s_id * src_stride, ALIGN)
        dst = tl.multiple_of(d_base.to(tl.pointer_type(kind)) + d_id * dst_stride, ALIGN)
        offs = start + tl.arange(0, TILE)
        mask = offs < words
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return copy_blocks_kernel


_KERNEL: list[Any] = []  # compiled lazily, once per process (triton is heavy)


def layer_views(t: torch.Tensor, layout: KVLayout | None = None) -> list[torch.Tensor]:
    """Per-layer `[num_blocks, layer_bytes]` uint8 views of a block-major cache or
    staging tensor `t` (any dtype, contiguous): no copy, they alias `t`. Without
    `layout`, `t` is shaped [num_blocks, num_layers, ...] (the engine's caches)."""
    flat = t.reshape(-1).view(torch.uint8)
    if layout is None:
        if t.dim() < 3:
            raise ValueError("a tensor without a layout is [num_blocks, num_layers, ...]")
        return list(flat.view(t.shape[0], t.shape[1], -1).unbind(1))
    if flat.numel() % layout.block_bytes:
        raise ValueError(f"{flat.numel()} bytes are not whole {layout.block_bytes}-byte blocks")
    blocks = flat.view(-1, layout.num_layers, layout.layer_bytes)
    return list(blocks.unbind(1))


def copy_blocks_reference(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                          src_ids: Sequence[int], dst_ids: Sequence[int],
                          layers: tuple[int, int] | None = None) -> None:
    """dst[l][dst_ids] = src[l][src_ids] for each layer l in `layers` (all by default):
    one torch index copy per layer."""
    first, end = (0, len(src)) if layers is None else layers
    s = torch.as_tensor(list(src_ids), dtype=torch.int64, device=src[0].device)
    d = torch.as_tensor(list(dst_ids), dtype=torch.int64, device=dst[0].device)
    for i in range(first, end):
        dst[i].index_copy_(0, d, src[i].index_select(0, s).to(dst[i].device))


def uses_kernel(device: torch.device) -> bool:
    """Whether copies on `device` launch the Triton kernel (CUDA, or the interpreter)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


class BlockCopy:
    """Copies blocks from one side to another (`layer_views` lists on one device) in
    one launch per call. Holds the per-layer pointer table: both sides must outlive it
    (the caller owns them)."""

    def __init__(self, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
        _check_sides(src, dst)
        self.src, self.dst = list(src), list(dst)
        self.device = src[0].device
        self.num_layers = len(src)
        self.layer_bytes = int(src[0].shape[1])
        strides = (int(src[0].stride(0)), int(dst[0].stride(0)))
        addresses = [v.data_ptr() for v in self.src] + [v.data_ptr() for v in self.dst]
        self.align = _alignment(addresses + list(strides) + [self.layer_bytes])
        self.word = min(self.align, 8)
        self.strides = (strides[0] // self.word, strides[1] // self.word)
        self.words = self.layer_bytes // self.word
        self.tile = min(_MAX_TILE, _pow2_at_least(self.words))
        self.kernel = uses_kernel(self.device)
        self._ptrs = torch.tensor(addresses, dtype=torch.int64).to(self.device) \
            if self.kernel else None

    def __call__(self, src_ids: Sequence[int], dst_ids: Sequence[int],
                 layers: tuple[int, int] | None = None, after: Any = None) -> None:
        """dst blocks `dst_ids` (layers `layers`, all by default) = src blocks `src_ids`,
        on the current stream; with `after` (a CUDA event), not before it completed. On
        CUDA nothing here waits for the device."""
        n = len(src_ids)
        if n != len(dst_ids):
            raise ValueError(f"{n} source blocks but {len(dst_ids)} destination blocks")
        first, end = (0, self.num_layers) if layers is None else layers
        if not 0 <= first < end <= self.num_layers:
            raise ValueError(f"bad layer range [{first}, {end}) of {self.num_layers}")
        if n == 0:
            return
        if not self.kernel:
            copy_blocks_reference(self.src, self.dst, src_ids, dst_ids, (first, end))
            return
        # An even number of columns (the pad past the grid): the second row then starts
        # 16-byte aligned whatever n is, so one variant of the kernel serves every chunk.
        pad = n % 2
        rows = [*src_ids, *[0] * pad, *dst_ids, *[0] * pad]
        if self.device.type == "cuda":
            # From pinned memory (torch's caching host allocator): the upload neither
            # waits for the stream nor blocks this thread.
            ids = torch.tensor(rows, dtype=torch.int64, pin_memory=True).to(
                self.device, non_blocking=True)
            if after is not None:
                torch.cuda.current_stream(self.device).wait_event(after)
        else:
            ids = torch.tensor(rows, dtype=torch.int64)
        if not _KERNEL:
            _KERNEL.append(_kernel())
        grid = (n, end - first, -(-self.words // self.tile))
        _KERNEL[0][grid](self._ptrs, ids, n + pad, self.num_layers, first, self.strides[0],
                         self.strides[1], self.words, WORD=self.word, ALIGN=self.align,
                         TILE=self.tile)


def plan_blocks(pairs: Pairs, layout: KVLayout, src_blocks: int,
                dst_blocks: int) -> dict[tuple[int, int], tuple[list[int], list[int]]]:
    """(src, dst) region pairs as block ids per layer range, {(first, end): (src ids,
    dst ids)}: one launch each (a chunk's regions share one range). ValueError for a
    region outside either cache (`src_blocks`, `dst_blocks` blocks): the kernel writes
    wherever the ids point. Checked per range, not per region (a chunk has hundreds)."""
    plan: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    top = layout.num_layers
    if isinstance(pairs, rr.BlockPairs):  # whole blocks: one layer range, ids at once
        if len(pairs):
            plan[(0, top)] = (pairs.block_ids("src"), pairs.block_ids("dst"))
        pairs = []
    for s, d in pairs:
        layers = (s.layer_start, top if s.layer_end is None else s.layer_end)
        n = s.num_blocks
        if (d.layer_start, top if d.layer_end is None else d.layer_end) != layers or \
                d.num_blocks != n or n < 1:
            raise ValueError(f"source {s} and destination {d} differ in size")
        src_ids, dst_ids = plan.get(layers) or plan.setdefault(layers, ([], []))
        if n == 1:
            src_ids.append(s.block_id)
            dst_ids.append(d.block_id)
        else:
            src_ids.extend(range(s.block_id, s.block_id + n))
            dst_ids.extend(range(d.block_id, d.block_id + n))
    for (first, end), (src_ids, dst_ids) in plan.items():
        if not 0 <= first < end <= top:
            raise ValueError(f"bad layer range [{first}, {end}) of {top} layers")
        for ids, blocks, side in ((src_ids, src_blocks, "source"),
                                  (dst_ids, dst_blocks, "destination")):
            low, high = min(ids), max(ids)
            if low < 0 or high >= blocks:
                raise ValueError(f"{side} blocks {low}..{high} reach outside a cache of "
                                 f"{blocks} blocks")
    return plan


def gather_blocks(cache: torch.Tensor, ids: Sequence[int], staging: torch.Tensor,
                  layout: KVLayout | None = None) -> None:
    """staging's first len(ids) blocks = blocks `ids` of `cache` (one launch; `layout`
    as for `layer_views`)."""
    BlockCopy(layer_views(cache, layout), layer_views(staging, layout))(
        ids, range(len(ids)))


def scatter_blocks(staging: torch.Tensor, cache: torch.Tensor, ids: Sequence[int],
                   layout: KVLayout | None = None) -> None:
    """Blocks `ids` of `cache` = staging's first len(ids) blocks (one launch)."""
    BlockCopy(layer_views(staging, layout), layer_views(cache, layout))(
        range(len(ids)), ids)


def staged_regions(cache: torch.Tensor, layout: KVLayout, regions: Sequence[Region],
                   limit: int = _STAGE_BYTES) -> Iterator[torch.Tensor]:
    """The bytes of `regions` of a block-major `cache` on the host, in order (flat uint8
    tensors): consecutive regions of one layer range gathered on the cache's device
    into one buffer of at most `limit` bytes (one launch) and brought over with one
    copy, not one copy (and one wait) per region; a region of `limit` bytes or more is
    contiguous in the cache and comes over as it is. Ordered on the current stream."""
    views = layer_views(cache, layout)
    flat = cache.reshape(-1).view(torch.uint8)
    batch: list[Region] = []
    size = 0
    for r in regions:
        n = r.nbytes(layout)
        if batch and (size + n > limit or r.layers(layout) != batch[0].layers(layout)):
            yield from _stage(views, layout, batch)
            batch, size = [], 0
        if n >= limit:
            off, n = r.resolve(layout, len(views[0]))
            yield flat[off:off + n].cpu()
            continue
        r.resolve(layout, len(views[0]))
        batch.append(r)
        size += n
    if batch:
        yield from _stage(views, layout, batch)


def _stage(views: list[torch.Tensor], layout: KVLayout,
           batch: list[Region]) -> Iterator[torch.Tensor]:
    first, end = batch[0].layers(layout)
    ids = [b for r in batch for b in range(r.block_id, r.block_id + r.num_blocks)]
    buf = torch.empty(len(ids), end - first, layout.layer_bytes, dtype=torch.uint8,
                      device=views[0].device)
    BlockCopy(views[first:end], list(buf.unbind(1)))(ids, range(len(ids)))
    host = buf.reshape(-1).cpu()
    off = 0
    for r in batch:
        n = r.nbytes(layout)
        yield host[off:off + n]
        off += n


def _check_sides(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    if not src or len(src) != len(dst):
        raise ValueError(f"{len(src)} source layers but {len(dst)} destination layers")
    size, device = int(src[0].shape[1]), src[0].device
    for side in (src, dst):
        for v in side:
            if v.dtype != torch.uint8 or v.dim() != 2 or v.stride(1) != 1:
                raise ValueError("each layer is a [num_blocks, layer_bytes] uint8 view")
            if int(v.shape[1]) != size or v.device != device:
                raise ValueError("every layer of both sides has one size and one device")
            if v.stride(0) != side[0].stride(0):
                raise ValueError("the layers of one side share one block stride")


def _alignment(values: Sequence[int]) -> int:
    """The widest of 16, 8, 4, 2, 1 bytes that divides every value."""
    acc = 0
    for v in values:
        acc |= v
    return next(a for a in (16, 8, 4, 2) if acc % a == 0) if acc % 2 == 0 else 1


def _pow2_at_least(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())
