"""GPU placement for `splitserve up`: which GPUs each worker gets.

Each worker runs with CUDA_VISIBLE_DEVICES naming its own GPUs (as many as its tensor
parallel size), so its ranks use cuda:0..N-1 of what it sees. Workers get disjoint
GPU sets, taken in order (prefill, decode, then colocated workers) from `--gpus` or
from every visible GPU; when they do not fit, the refusal names the arithmetic.
`--share-gpus` instead lets workers share GPUs round robin, each GPU's memory split
between its workers (--gpu-memory-utilization, which applies per GPU, divided by the
most workers any of the worker's GPUs hosts).

With `--transport cuda_ipc` or `auto` a prefill writes into a decode's cache on another
GPU through peer access, which needs both GPUs visible to the sender: there every
worker sees the whole pool in CUDA_VISIBLE_DEVICES and is given its first GPU with
`--device cuda:N` (its tensor-parallel ranks take cuda:N, N+1, ..., the same GPUs as
in its own set). A worker whose set wraps around the pool (`--share-gpus`) keeps
CUDA_VISIBLE_DEVICES naming its own GPUs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerPlacement:
    """One worker's extra flags and environment."""

    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    gpus: tuple[str, ...] = ()  # the GPU ids it was given (CUDA_VISIBLE_DEVICES' names)


def parse_gpus(text: str) -> list[int]:
    """'0,1,3' -> [0, 1, 3]: GPU indices as this process sees them."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--gpus takes GPU indices like 0,1,2,3, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise ValueError(f"--gpus takes GPU indices like 0,1,2,3, got {text!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"--gpus names a GPU twice: {text!r}")
    return ids


def visible_gpus(count: int | None = None) -> list[str]:
    """The GPUs this process sees, by the names a child's CUDA_VISIBLE_DEVICES takes
    (this process's own CUDA_VISIBLE_DEVICES entries when set). `count`: the number
    of visible devices (default: torch's count; 0 without a CUDA torch)."""
    if count is None:
        try:
            import torch

            count = torch.cuda.device_count()
        except ImportError:
            count = 0
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        names = [x.strip() for x in env.split(",") if x.strip()]
        return names[:count]
    return [str(i) for i in range(count)]


def _arithmetic(workers: Sequence[tuple[str, str, int]], need: int, have: int,
                source: str) -> str:
    sizes = {tp for _, _, tp in workers}
    if len(sizes) == 1:
        tp = sizes.pop()
        parts = f"{len(workers)} worker{'s' * (len(workers) != 1)} × TP {tp}"
    else:
        groups: dict[tuple[str, int], int] = {}
        for _, role, tp in workers:
            groups[(role, tp)] = groups.get((role, tp), 0) + 1
        parts = " + ".join(f"{n} {role} worker{'s' * (n != 1)} × TP {tp}"
                           for (role, tp), n in groups.items())
    return f"{parts} need {need} GPUs; {have} {source}"


def plan(workers: Sequence[tuple[str, str, int]], *, visible: Sequence[str],
         gpus: Sequence[int] | None = None, share: bool = False,
         memory_utilization: float | None = None,
         peer_view: bool = False) -> dict[str, WorkerPlacement]:
    """workers: (worker id, role, TP size) in start order; visible: the GPU names this
    process sees (visible_gpus); peer_view: every worker sees the pool and gets
    `--device cuda:N` (for cuda_ipc between GPUs). Returns each worker's placement;
    raises ValueError when they do not fit."""
    if memory_utilization is not None and not 0 < memory_utilization <= 1:
        raise ValueError("--gpu-memory-utilization must be in (0, 1]")
    if gpus is not None:
        bad = [g for g in gpus if g >= len(visible)]
        if bad:
            raise ValueError(f"--gpus names GPU {bad[0]}; {len(visible)} visible")
        pool = [visible[g] for g in gpus]
        source = "given by --gpus"
    else:
        pool = list(visible)
        source = "visible"
    need = sum(tp for _, _, tp in workers)
    if not share and need > len(pool):
        raise ValueError(_arithmetic(workers, need, len(pool), source)
                         + " (--share-gpus puts several workers on one GPU)")
    if share:
        widest = max((tp for _, _, tp in workers), default=1)
        if widest > len(pool):
            raise ValueError(f"a worker with TP {widest} needs {widest} GPUs; "
                             f"{len(pool)} {source}")
    sets: list[list[int]] = []
    nxt = 0
    for _, _, tp in workers:
        sets.append([(nxt + j) % len(pool) for j in range(tp)])
        nxt += tp
    users = [0] * len(pool)
    for s in sets:
        for g in s:
            users[g] += 1
    out = {}
    for (wid, _, tp), s in zip(workers, sets, strict=True):
        util = memory_utilization
        crowd = max(users[g] for g in s)
        if share and crowd > 1:
            util = round((memory_utilization or 0.9) / crowd, 4)
        args: list[str] = ["--tensor-parallel-size", str(tp)]
        if util is not None:
            args += ["--gpu-memory-utilization", str(util)]
        names = tuple(pool[g] for g in s)
        seen = names
        if peer_view and s == list(range(s[0], s[0] + tp)):
            seen = tuple(pool)
            args += ["--device", f"cuda:{s[0]}"]
        out[wid] = WorkerPlacement(tuple(args), (("CUDA_VISIBLE_DEVICES", ",".join(seen)),),
                                   names)
    return out


def plan_cpu(workers: Sequence[tuple[str, str, int]]) -> dict[str, WorkerPlacement]:
    """On CPU: only each worker's TP size."""
    return {wid: WorkerPlacement(("--tensor-parallel-size", str(tp)))
            for wid, _, tp in workers}
