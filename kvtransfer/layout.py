"""The KV layout both sides of a transfer must agree on, and regions within it.

The engine's KV cache is one block-major tensor

    [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

so a block is one contiguous byte range and so is a (block, layer range) slice:

    block b:  | layer 0: K V | layer 1: K V | ... | layer L-1: K V |
              ^ b * block_bytes                  ^ (b+1) * block_bytes

MLA models (DeepSeek) cache one latent vector and one rope key per token per layer,
shared by every head: layout `mla_latent_v1`, the same tensor with one part and one
"head" of `kv_lora_rank + qk_rope_head_dim` values,

    [num_blocks, num_layers, 1, block_size, 1, kv_lora_rank + qk_rope_head_dim]

so every byte count below (and so the hand-off, the tiers, peer fetch and the index)
follows from the layout with no code of its own.

This module is torch-free (the gateway imports kvtransfer without torch).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, overload

from kvtransfer.errors import LayoutMismatch

if TYPE_CHECKING:
    from engine.config import EngineConfig

# float8_e4m3fn: an FP8 KV cache (--kv-cache-dtype fp8), one byte per value.
DTYPE_SIZES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2,
                               "float8_e4m3fn": 1}
LAYOUT_NAME = "block_major_v1"
MLA_LAYOUT_NAME = "mla_latent_v1"
# Parts per token per layer: K and V, or (MLA) the one latent + rope key entry.
LAYOUT_PARTS: dict[str, int] = {LAYOUT_NAME: 2, MLA_LAYOUT_NAME: 1}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one KV block; `num_blocks` is not part of it (each side has its own)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    name: str = LAYOUT_NAME

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if int(getattr(self, field)) <= 0:
                raise ValueError(f"KVLayout.{field} must be positive")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(DTYPE_SIZES)}")
        if self.name not in LAYOUT_PARTS:
            raise ValueError(f"unsupported KV layout {self.name!r} "
                             f"(want one of {sorted(LAYOUT_PARTS)})")
        if self.name == MLA_LAYOUT_NAME and self.num_kv_heads != 1:
            raise ValueError("an MLA latent layout has one entry per token (num_kv_heads 1)")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def num_parts(self) -> int:
        """2 (K and V) or 1 (an MLA latent)."""
        return LAYOUT_PARTS[self.name]

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer of one block (K and V, or the latent)."""
        return (self.num_parts * self.block_size * self.num_kv_heads * self.head_dim
                * self.itemsize)

    @property
    def token_bytes(self) -> int:
        """Bytes one token's KV takes over all layers."""
        return self.block_bytes // self.block_size

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def tensor_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, self.num_parts, self.block_size,
                self.num_kv_heads, self.head_dim)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KVLayout:
        return cls(**json.loads(text))

    def check_same(self, other: KVLayout) -> None:
        """Raise `LayoutMismatch` naming every differing field (no silent garbage KV)."""
        diffs = [f"{f}: {getattr(self, f)!r} != {getattr(other, f)!r}"
                 for f in ("name", "num_layers", "num_kv_heads", "head_dim", "block_size",
                           "dtype")
                 if getattr(self, f) != getattr(other, f)]
        if diffs:
            raise LayoutMismatch("KV layout mismatch: " + "; ".join(diffs))


@dataclass(frozen=True, slots=True)
class Region:
    """`num_blocks` consecutive blocks from `block_id`, layers [layer_start, layer_end).

    A region spanning several blocks must cover every layer, so it stays contiguous.
    `layer_end=None` means all layers. Under tensor parallelism a region lies in one
    rank's cache (`rank`) and may cover only some of its KV heads,
    [head_start, head_end) in the rank's own numbering (`head_end=None`: all of them);
    the block interior is token-major, so such a head slice is one strided run per
    (block, layer, K/V, token), not one byte range.
    """

    block_id: int
    layer_start: int = 0
    layer_end: int | None = None
    num_blocks: int = 1
    rank: int = 0
    head_start: int = 0
    head_end: int | None = None

    def resolve(self, layout: KVLayout, total_blocks: int) -> tuple[int, int]:
        """(byte offset, nbytes) in a tensor of `total_blocks` (one rank's cache: the
        layout its heads); ValueError if outside, or if a head slice (no byte range)."""
        if (self.head_start, self.heads(layout)[1]) != (0, layout.num_kv_heads):
            raise ValueError(f"{self} is a head slice: strided, not one byte range")
        end = layout.num_layers if self.layer_end is None else self.layer_end
        if not 0 <= self.layer_start < end <= layout.num_layers:
            raise ValueError(f"bad layer range [{self.layer_start}, {end}) in {self}")
        if self.num_blocks < 1 or self.block_id < 0:
            raise ValueError(f"bad block range in {self}")
        if self.block_id + self.num_blocks > total_blocks:
            raise ValueError(f"{self} is outside a cache of {total_blocks} blocks")
        if self.num_blocks > 1 and (self.layer_start, end) != (0, layout.num_layers):
            raise ValueError(f"multi-block {self} must cover all layers")
        layer_bytes = layout.layer_bytes  # a computed property: once per call (hot path)
        block_bytes = layout.num_layers * layer_bytes
        offset = self.block_id * block_bytes + self.layer_start * layer_bytes
        if self.num_blocks > 1:
            return offset, self.num_blocks * block_bytes
        return offset, (end - self.layer_start) * layer_bytes

    def check(self, layout: KVLayout, total_blocks: int, tp: int = 1) -> None:
        """ValueError unless the region lies in rank caches of `total_blocks` blocks
        of `layout` (one rank's heads) of a TP `tp` worker."""
        first, end = self.head_start, self.heads(layout)[1]
        if not 0 <= self.rank < tp or not 0 <= first < end <= layout.num_kv_heads:
            raise ValueError(f"{self} is outside {tp} rank(s) of {layout.num_kv_heads} "
                             "KV heads")
        Region(self.block_id, self.layer_start, self.layer_end,
               self.num_blocks).resolve(layout, total_blocks)

    def whole_heads(self, layout: KVLayout) -> bool:
        """True where the region covers every head of its rank (one byte range)."""
        return self.head_start == 0 and self.heads(layout)[1] == layout.num_kv_heads

    def layers(self, layout: KVLayout) -> tuple[int, int]:
        return self.layer_start, layout.num_layers if self.layer_end is None else self.layer_end

    def heads(self, layout: KVLayout) -> tuple[int, int]:
        return self.head_start, layout.num_kv_heads if self.head_end is None else self.head_end

    def nbytes(self, layout: KVLayout) -> int:
        start, end = self.layers(layout)
        first, last = self.heads(layout)
        return (self.num_blocks * (end - start) * layout.layer_bytes * (last - first)
                // layout.num_kv_heads)


# A write's (source, destination) region pairs: a list, or `region_rows.BlockPairs`
# (whole blocks, read as rows without a Region each)
Pairs = Sequence[tuple[Region, Region]]


def coalesce(src: Sequence[Region], dst: Sequence[Region],
             layout: KVLayout) -> list[tuple[Region, Region]]:
    """Pair src/dst regions, merging whole blocks that are consecutive on both sides.

    Fewer, larger regions mean fewer headers and syscalls; a scattered destination
    (blocks 7, 3, 12) stays one region per block.
    """
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source regions but {len(dst)} destination regions")
    out: list[tuple[Region, Region]] = []
    for s, d in zip(src, dst, strict=True):
        if s.layers(layout) != d.layers(layout) or s.num_blocks != d.num_blocks:
            raise ValueError(f"source {s} and destination {d} differ in size")
        if out and _whole(s, layout) and _whole(out[-1][0], layout):
            ps, pd = out[-1]
            if ps.block_id + ps.num_blocks == s.block_id and \
                    pd.block_id + pd.num_blocks == d.block_id and \
                    _same_slice(ps, s) and _same_slice(pd, d):
                n = ps.num_blocks + s.num_blocks
                out[-1] = (replace(ps, num_blocks=n), replace(pd, num_blocks=n))
                continue
        out.append((s, d))
    return out


def _whole(r: Region, layout: KVLayout) -> bool:
    return r.layers(layout) == (0, layout.num_layers)


def _same_slice(a: Region, b: Region) -> bool:
    return (a.rank, a.head_start, a.head_end) == (b.rank, b.head_start, b.head_end)


class WholeBlocks(Sequence[Region]):
    """Whole blocks (every layer and head of rank 0) by id, as `whole_blocks` makes
    them: a sequence of one-block `Region`s, each made when it is read. What a hand-off
    moves; the sender and `region_rows` read `ids` as they are (an 8k-token prompt's 512
    scattered blocks are one int list, not 512 objects to build and walk)."""

    __slots__ = ("ids",)

    def __init__(self, ids: Iterable[int]) -> None:
        self.ids: list[int] = list(map(int, ids))

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> Region: ...

    @overload
    def __getitem__(self, i: slice) -> WholeBlocks: ...

    def __getitem__(self, i: int | slice) -> Region | WholeBlocks:
        if isinstance(i, slice):
            return WholeBlocks(self.ids[i])
        return Region(self.ids[i])

    def __iter__(self) -> Iterator[Region]:
        return map(Region, self.ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, WholeBlocks):
            return self.ids == other.ids
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, like a list

    def __repr__(self) -> str:
        return f"whole_blocks({self.ids!r})"


def whole_blocks(block_ids: Iterable[int]) -> WholeBlocks:
    """One whole-block region per block id (callers coalesce via `coalesce`)."""
    return WholeBlocks(block_ids)


def engine_layout(engine_config: EngineConfig) -> KVLayout:
    """The KV layout of an engine built from `engine_config`: what a worker registers
    with its transports and tiers, and checks at handshake (torch-free, like this
    module)."""
    from engine.config import ModelConfig

    m = ModelConfig.from_model_dir(engine_config.model_dir)
    _, heads, head_dim = m.kv_cache_dims
    return KVLayout(num_layers=m.num_layers, num_kv_heads=heads, head_dim=head_dim,
                    block_size=engine_config.cache.block_size,
                    dtype=engine_config.kv_dtype_name(m.dtype), name=m.kv_layout_name)


# -- tensor parallelism: which rank holds which KV heads --------------------------------
# Rank r of a TP t worker holds KV heads head_map(H, t)[r] of the model's H, in its own
# cache under the pool's block ids. With fewer heads than ranks (H < t) each head is
# replicated on t / H consecutive ranks. A transfer between a TP p and a TP d worker
# moves, for each destination rank, its heads from the source rank(s) holding them.


def head_map(num_kv_heads: int, tp: int) -> list[tuple[int, int]]:
    """[first, end) of the KV heads (of the model's) each rank of a TP `tp` worker holds.
    ValueError unless `tp` divides `num_kv_heads` or is a multiple of it."""
    if num_kv_heads < 1 or tp < 1:
        raise ValueError("num_kv_heads and tp must be positive")
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp} ranks")
        n = num_kv_heads // tp
        return [(r * n, (r + 1) * n) for r in range(tp)]
    if tp % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated over {tp} ranks")
    return [(r * num_kv_heads // tp, r * num_kv_heads // tp + 1) for r in range(tp)]


def local_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads one rank holds."""
    first, end = head_map(num_kv_heads, tp)[0]
    return end - first


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """`num_heads` consecutive KV heads that a destination rank takes from one source
    rank: heads [src_head, src_head + num_heads) of the source rank's cache (its own
    numbering) land at [dst_head, dst_head + num_heads) of the destination rank's."""

    src_rank: int
    src_head: int
    dst_head: int
    num_heads: int


def head_plan(src_tp: int, dst_tp: int, num_kv_heads: int) -> list[list[HeadSlice]]:
    """For each destination rank, the slices that fill every one of its heads, in head
    order. A head the source replicates is taken from one of its holders, spread over
    them by destination rank (TP p to TP p is rank r to rank r)."""
    src, dst = head_map(num_kv_heads, src_tp), head_map(num_kv_heads, dst_tp)
    plan: list[list[HeadSlice]] = []
    for d, (first, end) in enumerate(dst):
        slices: list[HeadSlice] = []
        for h in range(first, end):
            holders = [s for s, (a, b) in enumerate(src) if a <= h < b]
            s = holders[d % len(holders)]
            src_head, dst_head = h - src[s][0], h - first
            last = slices[-1] if slices else None
            if last is not None and last.src_rank == s and \
                    last.src_head + last.num_heads == src_head:
                slices[-1] = HeadSlice(s, last.src_head, last.dst_head, last.num_heads + 1)
            else:
                slices.append(HeadSlice(s, src_head, dst_head, 1))
        plan.append(slices)
    return plan


def rank_layout(layout: KVLayout, tp: int) -> KVLayout:
    """The layout of one rank's cache of a TP `tp` worker: its KV heads only."""
    return layout if tp == 1 else replace(layout, num_kv_heads=local_heads(
        layout.num_kv_heads, tp))


def rank_pairs(pairs: Sequence[tuple[Region, Region]], num_kv_heads: int, src_tp: int,
               dst_tp: int) -> list[tuple[Region, Region]]:
    """(source, destination) regions of whole-head blocks, as the per-rank slices that
    move them between a TP `src_tp` and a TP `dst_tp` worker (`head_plan`): for each
    destination rank, each source rank's run of its heads. A slice that covers all of
    its rank's heads keeps `head_end=None` (one byte range there)."""
    plan = head_plan(src_tp, dst_tp, num_kv_heads)
    src_n, dst_n = local_heads(num_kv_heads, src_tp), local_heads(num_kv_heads, dst_tp)

    def sliced(r: Region, rank: int, first: int, n: int, held: int) -> Region:
        return replace(r, rank=rank, head_start=first,
                       head_end=None if (first, n) == (0, held) else first + n)

    out: list[tuple[Region, Region]] = []
    for s, d in pairs:
        for dst_rank, slices in enumerate(plan):
            for h in slices:
                out.append((sliced(s, h.src_rank, h.src_head, h.num_heads, src_n),
                            sliced(d, dst_rank, h.dst_head, h.num_heads, dst_n)))
    return out
