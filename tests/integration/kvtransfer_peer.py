"""The other process of the kvtransfer two-process tests (run with `python -m`, or forked
from the tests' forkserver: `run_forked`).

One JSON spec (argv[1], or `run_forked`'s argument). Prints JSON lines on stdout:
{"address": ...} once a receiver listens, {"ready": true} once a sender is connected,
then one {"xfer", "ok", "kind"} per transfer. Source KV is deterministic from `seed`, so
the test process rebuilds it and checks the received blocks bit for bit.

GPU senders: a transfer with `overlap_s` queues that long of later work on the compute
stream after each write's `ready` event (as chunk c+1's forward follows chunk c's) and
reports whether the transfer finished while that work still ran (`overlapped`);
`hold_after_close` reports the device memory still allocated after `close()`, then
stops the process (alive, so its IPC mappings would still be open had close() kept
them) until the test kills it.

A receiver with `die_mid_write` (a one-byte file) SIGKILLs itself while a write's copy
into its cache runs: once the cache's first byte has landed it stores in that file 1 if
the last byte of each half (what two ucx lanes copy last) is still unwritten, else 2,
and dies, with no GIL release in between that would let its event loop take a notice
of a copy that ends meanwhile.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import json
import mmap
import os
import signal
import sys
import threading
from typing import Any

import torch

from kvtransfer import KVLayout, KVTransferError, Region, TransferConfig, make_receiver, make_sender


def make_kv(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(layout.tensor_shape(num_blocks), generator=g)
    return data.to(getattr(torch, layout.dtype)).contiguous()


def regions(items: list[list[int | None]]) -> list[Region]:
    return [Region(*item) for item in items]  # type: ignore[arg-type]


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


async def run_sender(spec: dict[str, Any]) -> None:
    layout = KVLayout(**spec["layout"])
    config = TransferConfig(**spec["config"])
    sender = make_sender(config)
    kv = make_kv(layout, spec["num_blocks"], spec["seed"]).to(spec.get("device", "cpu"))
    if kv.is_cuda:  # the process's own GPU, as a worker's engine sets it (--device cuda:N)
        torch.cuda.set_device(kv.device)
    before = torch.cuda.memory_allocated() if kv.is_cuda else 0
    sender.register(kv, layout)
    if spec.get("corrupt"):
        import kvtransfer.memory as memory
        real = memory.checksum

        def wrong(data: Any) -> int:
            return real(data) ^ 1

        memory.checksum = wrong  # what the regions' own checksum (KVMemory) calls
        for mod in list(sys.modules.values()):
            for name in ("checksum", "compute_checksum"):  # the names it is imported as
                if getattr(mod, name, None) is real:
                    setattr(mod, name, wrong)
    try:
        peer = await sender.connect(spec["address"])
    except KVTransferError as e:
        emit({"connect": False, "kind": e.kind, "message": str(e)})
        return
    emit({"ready": True, "path": getattr(sender, "paths", {}).get(id(peer), config.transport)})
    await asyncio.gather(*(send_one(sender, peer, t, spec) for t in spec["transfers"]))
    await sender.close()
    if spec.get("hold_after_close"):
        del sender, peer
        gc.collect()
        torch.cuda.synchronize()
        emit({"closed": True, "allocated": torch.cuda.memory_allocated() - before})
        os.kill(os.getpid(), signal.SIGSTOP)


async def send_one(sender: Any, peer: Any, t: dict[str, Any], spec: dict[str, Any]) -> None:
    try:
        # Streaming: several write() calls per transfer, as a prefill would per layer,
        # after announcing the whole destination (the grant of an in-place transport).
        later = None
        await sender.begin(peer, [r for dst in t["dst"] for r in regions(dst)], t["xfer"],
                           t["gen"])
        for i, (src, dst) in enumerate(zip(t["src"], t["dst"], strict=True)):
            ready, later = chunk_events(t.get("overlap_s"))
            await sender.write(peer, regions(src), regions(dst), t["xfer"], t["gen"],
                               checksum=t.get("checksum"), ready=ready)
            if spec.get("stop_after_first_write") and i == 0:
                emit({"stopping": True})
                os.kill(os.getpid(), signal.SIGSTOP)
        await sender.finish(peer, t["xfer"], timeout_s=t.get("finish_timeout"))
        extra = {} if later is None else {"overlapped": not later.query()}
        emit({"xfer": t["xfer"], "ok": True, "kind": "", **extra})
    except KVTransferError as e:
        emit({"xfer": t["xfer"], "ok": False, "kind": e.kind, "message": str(e)})


def chunk_events(overlap_s: float | None) -> tuple[Any, Any]:
    """(ready, later): `ready` recorded on the compute stream now (the chunk's forward
    is done), then `overlap_s` of busy work queued after it (the next chunk's forward),
    `later` after that. (None, None) without `overlap_s`."""
    if not overlap_s:
        return None, None
    ready, later = torch.cuda.Event(), torch.cuda.Event()
    ready.record()
    torch.cuda._sleep(int(overlap_s * 2e9))  # cycles: ~1 s per 2e9 at H100 clocks
    later.record()
    return ready, later


async def run_receiver(spec: dict[str, Any]) -> None:
    layout = KVLayout(**spec["layout"])
    config = TransferConfig(**spec["config"])
    receiver = make_receiver(config)
    if config.transport == "shm":
        receiver.allocate(layout, spec["num_blocks"])  # type: ignore[attr-defined]
    else:
        receiver.register(torch.zeros(layout.tensor_shape(spec["num_blocks"]),
                                      dtype=getattr(torch, layout.dtype),
                                      device=spec.get("device", "cpu")), layout)
    await receiver.start()
    if spec.get("die_mid_write"):
        threading.Thread(target=die_mid_write, args=(receiver.kv.tensor, spec["die_mid_write"]),
                         daemon=True).start()
    futures = {t["xfer"]: receiver.expect(t["xfer"], regions(t["dst"]), t["gen"])
               for t in spec["transfers"]}
    emit({"address": receiver.address()})
    for xfer, fut in futures.items():
        try:
            await fut
            emit({"xfer": xfer, "ok": True, "kind": ""})
        except KVTransferError as e:
            emit({"xfer": xfer, "ok": False, "kind": e.kind})
    await receiver.close()


def die_mid_write(kv: torch.Tensor, path: str) -> None:
    fd = os.open(path, os.O_RDWR)
    verdict = mmap.mmap(fd, 1)
    cells = kv.view(-1).view(torch.uint8).numpy()  # the test's KV has no zero byte
    half = len(cells) // 2
    while cells[0] == 0:
        pass
    verdict[0] = 1 if cells[half - 1] == 0 and cells[-1] == 0 else 2
    os.kill(os.getpid(), signal.SIGKILL)


def run(spec: dict[str, Any]) -> None:
    asyncio.run(run_sender(spec) if spec["role"] == "sender" else run_receiver(spec))


def run_forked(spec: str, out: Any, err: Any) -> None:
    """`run` in a process forked from the tests' forkserver (`kvtransfer_util`, torch
    imported there once): stdout, its lines included, goes to the pipe `out`, stderr
    to `err` (the test process's)."""
    for conn, fd in ((out, 1), (err, 2)):
        os.dup2(conn.fileno(), fd)
        conn.close()
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - fd 1, for the process's life
    run(json.loads(spec))
    # multiprocessing ends the child with os._exit: run the teardown an interpreter's
    # exit would (atexit handlers, then finalizers), so a crash in it shows in the exit
    # code
    atexit._run_exitfuncs()
    gc.collect()
    sys.stdout.flush()


def main() -> None:
    run(json.loads(sys.argv[1]))


if __name__ == "__main__":
    main()
