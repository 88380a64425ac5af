"""Head slices packed on the sender, so ucx moves them between TP sizes in large puts.

Between a TP p and a TP d worker (p != d) `layout.rank_pairs` cuts each whole-block
region into per-rank head slices, and in the token-major block interior a slice is one
strided run per (block, layer, K/V, token): 2 KiB for Qwen3-0.6B at TP 2, so a prompt
of 2048 tokens is ~10^5 runs, and one RMA put per run costs more than its copy.

But the slices a destination rank takes of one region always fill every one of its
heads (`head_plan`), so together they are one byte range there: a *tile*. The sender
assembles a tile in a registered bounce buffer with numpy (one strided copy per slice,
at memory speed), laid out as the destination rank's blocks, and puts it whole:

    destination rank's block (token-major):  | t0: h0 h1 h2 h3 | t1: h0 h1 h2 h3 | ...
    from source rank 0 (heads 0-1)              ^^^^^             ^^^^^
    from source rank 1 (heads 2-3)                    ^^^^^             ^^^^^

No byte lands outside the slices' own cells, so the receiver's fencing per cell and its
checksums per slice are the same as with one put per run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvtransfer.layout import KVLayout, Pairs, Region
from kvtransfer.memory import RegisteredKV
from kvtransfer.ucp_rma import Ucp


@dataclass(frozen=True, slots=True)
class Tile:
    """Every head of destination region `dst` (one rank's, whole heads), filled by
    `slices` (source slice, destination slice), in head order."""

    dst: Region
    slices: tuple[tuple[Region, Region], ...]
    nbytes: int


def tiles(pairs: Pairs, src_layout: KVLayout, dst_layout: KVLayout,
          max_bytes: int) -> tuple[list[Tile], list[tuple[Region, Region]]]:
    """(tiles, rest): the pairs that are head slices on either side, grouped into tiles
    of at most `max_bytes` (at least one block), and the pairs left to move as they
    are (whole rank blocks on both sides, or slices that fill no destination region)."""
    groups: dict[tuple[int, ...], list[tuple[Region, Region]]] = {}
    rest: list[tuple[Region, Region]] = []
    for s, d in pairs:
        if s.whole_heads(src_layout) and d.whole_heads(dst_layout):
            rest.append((s, d))
        else:
            key = (d.rank, d.block_id, d.num_blocks, *d.layers(dst_layout))
            groups.setdefault(key, []).append((s, d))
    out: list[Tile] = []
    for group in groups.values():
        group.sort(key=lambda p: p[1].head_start)
        if not _fills(group, src_layout, dst_layout):
            rest += group
            continue
        dst = replace(group[0][1], head_start=0, head_end=None)
        out += _split(dst, group, dst_layout, max_bytes)
    return out, rest


def _fills(group: list[tuple[Region, Region]], src_layout: KVLayout,
           dst_layout: KVLayout) -> bool:
    """True where the destination slices tile [0, heads) of their rank, each as wide
    as its source slice."""
    end = 0
    for s, d in group:
        first, last = d.heads(dst_layout)
        if first != end or s.num_blocks != d.num_blocks or \
                s.heads(src_layout)[1] - s.head_start != last - first:
            return False
        end = last
    return end == dst_layout.num_kv_heads


def _split(dst: Region, group: list[tuple[Region, Region]], layout: KVLayout,
           max_bytes: int) -> list[Tile]:
    per_block = dst.nbytes(layout) // dst.num_blocks
    k = max(1, max_bytes // per_block)
    if dst.num_blocks <= k:
        return [Tile(dst, tuple(group), dst.nbytes(layout))]
    out = []
    for i in range(0, dst.num_blocks, k):
        n = min(k, dst.num_blocks - i)
        part = tuple((replace(s, block_id=s.block_id + i, num_blocks=n),
                      replace(d, block_id=d.block_id + i, num_blocks=n)) for s, d in group)
        out.append(Tile(replace(dst, block_id=dst.block_id + i, num_blocks=n), part,
                        n * per_block))
    return out


def batches(tiles: list[Tile], max_bytes: int) -> Iterator[list[Tile]]:
    """Consecutive tiles of at most `max_bytes` together (one tile at least)."""
    batch: list[Tile] = []
    size = 0
    for tile in tiles:
        if batch and size + tile.nbytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(tile)
        size += tile.nbytes
    if batch:
        yield batch


def pack(kv: RegisteredKV, batch: list[Tile], dst_layout: KVLayout, out: np.ndarray,
         ) -> list[int]:
    """Lay `batch`'s tiles one after another into the flat byte array `out`, each as
    its destination region's bytes; returns each tile's offset in `out`."""
    offsets, at = [], 0
    width = dst_layout.head_dim * dst_layout.itemsize
    for tile in batch:
        first, last = tile.dst.layers(dst_layout)
        view = out[at:at + tile.nbytes].reshape(
            tile.dst.num_blocks, last - first, dst_layout.num_parts, dst_layout.block_size,
            dst_layout.num_kv_heads, width)
        for s, d in tile.slices:
            np.copyto(view[:, :, :, :, d.head_start:d.heads(dst_layout)[1]], kv.host_array(s))
        offsets.append(at)
        at += tile.nbytes
    return offsets


class Bounce:
    """A host buffer registered with every lane's UCP context: where tiles are packed
    and put from. Owned by one sender; `close` only once no put reads it."""

    def __init__(self, ucp: Ucp, contexts: list[int], nbytes: int) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.array = self.tensor.numpy()
        self.address = int(self.tensor.data_ptr())
        self.nbytes = nbytes
        self.memhs = [ucp.mem_map(c, self.address, nbytes, False) for c in contexts]
        self._contexts = contexts

    def close(self, ucp: Ucp) -> None:
        for context, memh in zip(self._contexts, self.memhs, strict=True):
            ucp.mem_unmap(context, memh)
        self.memhs = []


# put(memhs, rows): put rows (local address, nbytes, remote address) by destination
# rank, from memory registered as `memhs` (one per lane); returns once flushed.
PutRows = Callable[[list[int], dict[int, list[tuple[int, int, int]]]], Awaitable[None]]


class Packer:
    """A sender's two bounce buffers (of `nbytes`, or a tile's size if more) and the
    pipeline over them: the next batch of tiles is packed into one while the other's
    puts run. One write packs at a time (the buffers are the sender's)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buffers: list[Bounce] = []
        # (owner, buffers) that puts to `owner` may still read: freed by `release`
        self._retired: list[tuple[object, list[Bounce]]] = []
        self._lock = asyncio.Lock()

    async def put(self, kv: RegisteredKV, tiles: list[Tile], there: KVLayout,
                  bases: list[int], put: PutRows, ucp: Ucp, contexts: list[int],
                  owner: object = None) -> None:
        """Pack `tiles` of `kv` and put each whole into its region of the receiver's
        rank caches at `bases` (of `there`'s layout), the receiver `owner`. A failure or
        cancellation retires the buffers until `release(owner)`: puts from them to
        `owner` may still be in flight."""
        async with self._lock:
            buffers = self._ready(max(t.nbytes for t in tiles), ucp, contexts)
            puts: list[asyncio.Future[None] | None] = [None] * len(buffers)
            try:
                for i, batch in enumerate(batches(tiles, buffers[0].nbytes)):
                    buf, slot = buffers[i % len(buffers)], i % len(buffers)
                    if (last := puts[slot]) is not None:
                        await last  # flushed: the buffer is free again
                    offsets = await asyncio.to_thread(pack, kv, batch, there, buf.array)
                    rows: dict[int, list[tuple[int, int, int]]] = {}
                    for tile, off in zip(batch, offsets, strict=True):
                        at = tile.dst.block_id * there.block_bytes + \
                            tile.dst.layer_start * there.layer_bytes
                        rows.setdefault(tile.dst.rank, []).append(
                            (buf.address + off, tile.nbytes, bases[tile.dst.rank] + at))
                    puts[slot] = asyncio.ensure_future(put(buf.memhs, rows))
                for pending in puts:
                    if pending is not None:
                        await pending
            except BaseException:
                for pending in puts:
                    if pending is None:
                        continue
                    if not pending.done():
                        pending.cancel()
                    elif not pending.cancelled():
                        pending.exception()  # the first error is the one raised
                self._retired.append((owner, self._buffers))
                self._buffers = []
                raise

    def _ready(self, nbytes: int, ucp: Ucp, contexts: list[int]) -> list[Bounce]:
        if self._buffers and self._buffers[0].nbytes < nbytes:
            for buf in self._buffers:  # too small; every put from it was flushed
                buf.close(ucp)
            self._buffers = []
        if not self._buffers:
            size = max(self.nbytes, nbytes)
            self._buffers = [Bounce(ucp, contexts, size) for _ in range(2)]
        return self._buffers

    def release(self, owner: object, ucp: Ucp) -> None:
        """Unmap the buffers retired on `owner`'s account: call once nothing puts to it
        (its endpoints closed, no lane thread issuing)."""
        for who, buffers in self._retired:
            if who is owner:
                for buf in buffers:
                    buf.close(ucp)
        self._retired = [(who, b) for who, b in self._retired if who is not owner]

    def close(self, ucp: Ucp) -> None:
        """Unmap every buffer: call once no lane thread runs (the put pool shut down)."""
        for buf in self._buffers + [b for _, buffers in self._retired for b in buffers]:
            buf.close(ucp)
        self._buffers, self._retired = [], []
