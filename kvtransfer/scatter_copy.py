"""One batched gather-scatter copy: many (src offset, dst offset, nbytes) regions in a
single Triton launch, between two byte tensors on one device (or on the CPU under
Triton's interpreter, which is how the CPU tests check it).

`cuda_ipc` moves a chunk's blocks with one launch instead of one copy per block (at
~35 µs of host time per launch on the H100 host, 512 copies would cost ~18 ms), and
`bench transfer --device cuda` uses the same kernel in one process as its reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_BLOCK = 4096  # words per program


def _kernel():  # type: ignore[no-untyped-def]
    import triton
    import triton.language as tl

    @triton.jit
    def scatter_copy_kernel(src, dst, src_off, dst_off, size, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        pair = tl.program_id(0)
        start = tl.program_id(1).to(tl.int64) * BLOCK
        n = tl.load(size + pair)
        if start < n:
            s = tl.load(src_off + pair)
            d = tl.load(dst_off + pair)
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + d + offs, tl.load(src + s + offs, mask=mask), mask=mask)

    return scatter_copy_kernel


_KERNEL: list[object] = []  # compiled lazily, once per process (triton is heavy)


def scatter_copy(src: torch.Tensor, dst: torch.Tensor,
                 regions: Sequence[tuple[int, int, int]], after: Any = None) -> None:
    """dst[d:d+n] = src[s:s+n] for every (s, d, n) in bytes, in one launch on the
    current stream. `src` and `dst` are flat uint8 tensors on the same device. With
    `after` (a CUDA event), the launch waits for it on the device; the region table goes
    up before that wait (a copy from pageable memory synchronizes its stream first: after
    the wait, the calling thread would block until `after` completed)."""
    if not regions:
        return
    if src.dtype != torch.uint8 or dst.dtype != torch.uint8 or src.device != dst.device:
        raise ValueError("scatter_copy takes flat uint8 tensors on one device")
    word = _word_size(src, dst, regions)
    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
    # An even number of columns, the pad copying nothing (size 0, past the grid): every
    # row then starts 16-byte aligned, so Triton compiles (and a process loads) one
    # variant of the kernel, not one per parity of len(regions). A variant loaded while
    # the GPU computes waits for it (see `CudaMover.prepare`).
    rows = [[s // word, d // word, n // word] for s, d, n in regions]
    table = torch.tensor(rows + [[0, 0, 0]] * (len(rows) % 2), dtype=torch.int64).T.contiguous()
    if src.is_cuda:
        table = table.to(src.device, non_blocking=True)
        if after is not None:
            torch.cuda.current_stream(src.device).wait_event(after)
    longest = int(table[2].max()) if not src.is_cuda else max(n for *_, n in regions) // word
    if not _KERNEL:
        _KERNEL.append(_kernel())
    grid = (len(regions), -(-longest // _BLOCK))
    _KERNEL[0][grid](src.view(dtype), dst.view(dtype), table[0], table[1], table[2],  # type: ignore[index]
                     BLOCK=_BLOCK)


def _word_size(src: torch.Tensor, dst: torch.Tensor,
               regions: Sequence[tuple[int, int, int]]) -> int:
    """The widest word every offset, size and both tensors' lengths are aligned to."""
    acc = src.numel() | dst.numel() | src.data_ptr() | dst.data_ptr()
    for s, d, n in regions:
        acc |= s | d | n
    for word in (8, 4, 2):
        if acc % word == 0:
            return word
    return 1
