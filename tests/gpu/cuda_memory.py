"""What keeps CUDA memory allocated in this process, for a leak's assertion message.

`record()` turns on torch's allocation history (a stack per allocation); `holders()`
then lists every block still allocated with where it was allocated, and every live CUDA
tensor with the chains of referrers that keep it alive. A block with no live tensor over it is held
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


def _label(holder: Any, obj: Any) -> str:
    """`holder`'s type, and where in it `obj` sits (a dict's key, an object's attribute)."""
    name = _name(holder)
    if isinstance(holder, dict):
        keys = [k for k, v in holder.items() if v is obj][:2]
        name += f"[{', '.join(map(repr, keys))}]" if keys else ""
    elif hasattr(holder, "__dict__") and not isinstance(holder, type):
        attrs = [k for k, v in vars(holder).items() if v is obj][:2]
        name += f".{'/'.join(attrs)}" if attrs else ""
    return name


def _chains(obj: Any, skip: set[int], depth: int = 7, width: int = 6) -> list[str]:
    """Who keeps `obj` alive: paths of referrers up to a root (a module's dict,
    a class, something not tracked by gc) or `depth` levels, at most `width` of them."""
    out: list[str] = []
    stack: list[tuple[Any, list[str], set[int]]] = [(obj, [], {id(obj)})]
    mine = set(skip) | {id(stack), id(sys._getframe())}  # this search's own lists
    while stack and len(out) < width:
        item = stack.pop()
        cur, path, seen = item
        found = gc.get_referrers(cur)
        mine |= {id(item), id(found)}
        refs = [r for r in found if id(r) not in mine and id(r) not in seen]
        mine.add(id(refs))
        del found
        if not refs or len(path) >= depth:
            out.append(" <- ".join(path) or "(no referrer)")
            continue
        for r in refs[:width]:
            label = _label(r, cur)
            root = isinstance(r, (type, types.ModuleType)) or (
                isinstance(r, dict) and "__name__" in r and "__builtins__" in r)
            if root:
                out.append(" <- ".join(path + [label]))
            else:
                pushed = (r, path + [label], seen | {id(r)})
                mine.add(id(pushed))
                stack.append(pushed)
    return out[:width]


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
    shown = tensors[:limit]
    skip = {id(tensors), id(shown), id(sys._getframe())}
    for t in shown:
        out.append(f"tensor {tuple(t.shape)} {t.dtype} at {t.data_ptr():#x} "
                   f"({t.untyped_storage().nbytes()} B storage), kept by:")
        out.extend(f"  {chain}" for chain in _chains(t, skip))
    if not tensors:
        out.append("no live CUDA tensor: what is allocated is held by torch itself "
                   "(e.g. an IPC-shared storage in its limbo)")
    return "\n".join(out)
