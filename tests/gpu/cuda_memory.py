"""What keeps CUDA memory allocated in this process, for a leak's assertion message.

`record()` turns on torch's allocation history (a stack per allocation); `holders()`
then lists every block still allocated with where it was allocated, and every live CUDA
tensor with the types of what refers to it. A block with no live tensor over it is held
by torch itself: a storage shared over CUDA IPC waits in torch's "limbo" until each
consumer has let go of it (kvtransfer/cuda_ipc.py)."""

from __future__ import annotations

import gc
import sys
import types
from typing import Any

import torch


def record() -> None:
    """Allocation stacks from now on (Python frames; best effort across torch versions)."""
    try:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    except Exception as e:  # an older or newer signature: the leak message says so
        print(f"cuda_memory: no allocation history ({e})")


def _frames(block: dict[str, Any]) -> str:
    frames = [f for f in block.get("frames", []) if str(f.get("filename", "")).endswith(".py")]
    return " <- ".join(f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']} {f['name']}"
                       for f in frames[:6]) or "(no stack recorded)"


def _name(obj: Any) -> str:
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_name} ({obj.f_code.co_filename.rsplit('/', 1)[-1]}" \
               f":{obj.f_lineno})"
    return type(obj).__name__


def _referrers(obj: Any, skip: set[int], depth: int = 2) -> list[str]:
    """What refers to `obj`, and (for dicts, lists, tuples and cells: an object's
    attributes, a container) what refers to those, `depth` levels up."""
    out = []
    for r in gc.get_referrers(obj):
        if id(r) in skip:
            continue
        name = _name(r)
        if depth > 1 and isinstance(r, (dict, list, tuple, types.CellType)):
            name += f" <- {_referrers(r, skip | {id(r)}, depth - 1)}"
        out.append(name)
    return sorted(set(out))[:8]


def holders(limit: int = 12) -> str:
    """The allocated blocks (size, address, allocation stack) and the live CUDA tensors
    (shape, data pointer, referrer types), at most `limit` of each."""
    gc.collect()
    out = [f"allocated: {torch.cuda.memory_allocated()} B"]
    try:
        snap = torch.cuda.memory._snapshot()
        blocks = [(seg, b) for seg in snap.get("segments", []) for b in seg.get("blocks", [])
                  if b.get("state") == "active_allocated"]
        for seg, b in blocks[:limit]:
            out.append(f"block {b.get('size')} B at {b.get('address', seg.get('address', 0)):#x}"
                       f": {_frames(b)}")
    except Exception as e:
        out.append(f"no allocator snapshot: {e}")
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    skip = {id(tensors), id(sys._getframe())}
    for t in tensors[:limit]:
        out.append(f"tensor {tuple(t.shape)} {t.dtype} at {t.data_ptr():#x} "
                   f"({t.untyped_storage().nbytes()} B storage), referred to by "
                   f"{_referrers(t, skip)}")
    if not tensors:
        out.append("no live CUDA tensor: what is allocated is held by torch itself "
                   "(e.g. an IPC-shared storage in its limbo)")
    return "\n".join(out)
