"""Helpers for the kvtransfer two-process tests: spawn the peer, read its lines,
and check that no socket or shared-memory segment is left behind."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtransfer import KVLayout, TransferConfig, make_receiver, make_sender, wire
from tests.factories import child_env

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "cluster-secret"
LAYOUT_F32 = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=8, dtype="float32")
LAYOUT_BF16 = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=8,
                       dtype="bfloat16")
# An FP8 KV cache (--kv-cache-dtype fp8): one byte a value.
LAYOUT_FP8 = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=8,
                      dtype="float8_e4m3fn")
# DeepSeek's MLA cache: one latent + rope key "head" per token, one part (not K and V);
# the same bytes per block as LAYOUT_F32, so only the layout's name tells them apart.
LAYOUT_MLA = KVLayout(num_layers=4, num_kv_heads=1, head_dim=64, block_size=8, dtype="float32",
                      name="mla_latent_v1")

NO_UCX = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                            reason="ucxx not installed")
TRANSPORTS = [
    "tcp",
    "shm",
    "cuda_ipc",  # host caches here: the same protocol with the host mover
    pytest.param("ucx", marks=NO_UCX),
]
# The in-place writers (`kvtransfer/inplace.py`): a grant, revocable
IN_PLACE = ["shm", "cuda_ipc", pytest.param("ucx", marks=NO_UCX)]
STALE = "splitserve:kv_transfer_stale_writes_dropped_total"


def fast_config(transport: str, **kw: Any) -> TransferConfig:
    # The lease outlasts a peer process's start-up on a loaded 2-core box (a fresh
    # interpreter's torch import alone can take over 10 s while other test processes
    # run): a test that is about a lease sets its own.
    base: dict[str, Any] = dict(transport=transport, token=TOKEN, io_timeout_s=5.0,
                                heartbeat_s=0.2, liveness_timeout_s=1.5, lease_s=60.0)
    base.update(kw)
    return TransferConfig(**base)


def config_dict(config: TransferConfig) -> dict[str, Any]:
    d = asdict(config)
    if config.ucx_options is not None:
        d["ucx_options"] = [list(p) for p in config.ucx_options]
    return d


def make_kv(layout: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    from tests.integration.kvtransfer_peer import make_kv as peer_make_kv
    return peer_make_kv(layout, num_blocks, seed)


# Every peer process the tests of this process started: shm_segments looks at theirs only.
SPAWNED_PIDS: set[int] = set()


@functools.cache
def _forkserver() -> Any:
    """The multiprocessing context whose server imported the peer (torch, kvtransfer and
    its tcp, shm and cuda_ipc transports; ucxx loads in the peer that uses it) once for
    this test process: a peer forked from it starts in ~0.1 s, not the seconds of a
    fresh interpreter's imports."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.integration.kvtransfer_peer", "kvtransfer.tcp",
                                "kvtransfer.shm", "kvtransfer.cuda_ipc"])
    return ctx


class _Forked:
    """A host peer forked from `_forkserver()`, with the calls of asyncio's Process the
    tests use: pid, stdout (its lines), returncode, wait(), kill()."""

    def __init__(self, proc: Any, stdout: asyncio.StreamReader, pipe: Any) -> None:
        self.proc, self.stdout, self._pipe = proc, stdout, pipe
        self.pid: int = proc.pid
        self._code: int | None = None  # kept: a closed Process has no exitcode
        self._closed = False

    @classmethod
    async def start(cls, spec: dict[str, Any]) -> _Forked:
        from tests.integration.kvtransfer_peer import run_forked

        ctx = _forkserver()
        reader, writer = ctx.Pipe(duplex=False)
        # its stderr: this process's (pytest's capture of it), as a child's would be
        err = multiprocessing.connection.Connection(os.dup(2), readable=False)
        proc = ctx.Process(target=run_forked, args=(json.dumps(spec), writer, err),
                           daemon=True)
        try:
            try:
                await asyncio.to_thread(proc.start)  # the first one starts the server
            finally:
                writer.close()  # the child's copy is the only writer: EOF when it exits
                err.close()
            stdout = asyncio.StreamReader()
            pipe, _ = await asyncio.get_running_loop().connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(stdout),
                os.fdopen(os.dup(reader.fileno()), "rb", buffering=0))
        except BaseException:
            if proc.pid is not None:
                proc.kill()
                await asyncio.to_thread(proc.join, 10)
            proc.close()
            raise
        finally:
            reader.close()
        return cls(proc, stdout, pipe)

    @property
    def returncode(self) -> int | None:
        if self._code is None:
            self._code = self.proc.exitcode
        return self._code

    async def wait(self) -> int:
        """Its exit code, once it exited and what it wrote reached `stdout` (the pipe
        read to EOF; lines not read yet stay readable). Closes the Process then."""
        while self.returncode is None:
            await asyncio.sleep(0.02)
        if self._code is not None and not self._closed:
            self._closed = True
            # the pipe transport closes itself at EOF, after the last bytes went to
            # `stdout`; a grandchild holding the write end keeps it open: bounded
            with contextlib.suppress(TimeoutError):
                async with wire.deadline(10.0):
                    while not self._pipe.is_closing():
                        await asyncio.sleep(0.01)
            self._pipe.close()
            self.proc.close()
        return int(self._code)

    def kill(self) -> None:
        if self.returncode is None:
            self.proc.kill()


class PeerProcess:
    """The other process; lines are JSON objects read with a deadline. A host peer is
    forked from the forkserver (`_forkserver`); one on a GPU, with an environment of
    its own, or asked `fresh`, is a fresh interpreter (its exit code covers the
    interpreter's teardown)."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str] | None = None,
                 fresh: bool = False) -> None:
        self.proc: Any = None  # asyncio.subprocess.Process or _Forked
        self.spec = spec
        self.env = env or {}
        self.fresh = fresh

    async def start(self) -> PeerProcess:
        if not self.fresh and not self.env and self.spec.get("device", "cpu") == "cpu":
            self.proc = await _Forked.start(self.spec)
        else:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.integration.kvtransfer_peer",
                json.dumps(self.spec), stdout=subprocess.PIPE,
                env={**child_env(), **self.env}, cwd=str(ROOT))
        SPAWNED_PIDS.add(self.proc.pid)
        return self

    async def line(self, timeout: float = 30.0) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        while raw and not raw.startswith(b"{"):  # UCX prints its warnings on stdout
            raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not raw:
            raise EOFError("peer exited")
        obj: dict[str, Any] = json.loads(raw)
        return obj

    async def lines(self, n: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        return [await self.line(timeout) for _ in range(n)]

    async def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return await asyncio.wait_for(self.proc.wait(), timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()

    async def aclose(self) -> None:
        self.kill()
        if self.proc is not None:
            await self.proc.wait()


def spec(role: str, config: TransferConfig, layout: KVLayout, num_blocks: int,
         transfers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"role": role, "config": config_dict(config), "layout": asdict(layout),
            "num_blocks": num_blocks, "seed": extra.pop("seed", 1234),
            "transfers": transfers, **extra}


async def start_receiver(config: TransferConfig, layout: KVLayout, num_blocks: int,
                         device: str = "cpu") -> Any:
    receiver = make_receiver(config)
    if config.transport == "shm":
        receiver.allocate(layout, num_blocks)
    else:
        receiver.register(torch.zeros(layout.tensor_shape(num_blocks),
                                      dtype=getattr(torch, layout.dtype), device=device),
                          layout)
    await receiver.start()
    return receiver


def start_sender(config: TransferConfig, layout: KVLayout, num_blocks: int, seed: int) -> Any:
    sender = make_sender(config)
    sender.register(make_kv(layout, num_blocks, seed), layout)
    return sender


@contextlib.asynccontextmanager
async def receiving(config: TransferConfig, layout: KVLayout,
                    num_blocks: int) -> AsyncIterator[Any]:
    """A started receiver of `num_blocks`, closed on the way out."""
    receiver = await start_receiver(config, layout, num_blocks)
    try:
        yield receiver
    finally:
        await receiver.close()


@contextlib.asynccontextmanager
async def sender_child(config: TransferConfig, layout: KVLayout, dst_blocks: int,
                       src_blocks: int, plan: list[dict[str, Any]], fresh: bool = False,
                       **extra: Any) -> AsyncIterator[tuple[Any, PeerProcess]]:
    """A started receiver of `dst_blocks` here and a sender process of `src_blocks`
    (seed 1234) that will run `plan` into it: (receiver, peer), the peer not started yet
    (the test expects its transfers first); `fresh` and `extra` as for `PeerProcess` and
    `spec`. The peer is killed and the receiver closed on the way out."""
    async with receiving(config, layout, dst_blocks) as receiver:
        peer = PeerProcess(spec("sender", config, layout, src_blocks, plan,
                                address=receiver.address(), **extra), fresh=fresh)
        try:
            yield receiver, peer
        finally:
            await peer.aclose()


async def plan_lands(receiver: Any, peer: PeerProcess, plan: list[dict[str, Any]],
                     futures: list[Any], src_blocks: int) -> None:
    """Starts `peer` (a sender of `sender_child`), and checks that every transfer of
    `plan` (all in flight at once on the sender) succeeded on both sides, the sender
    exited cleanly, and the receiver's cache holds the plan's blocks bit-exact and
    nothing else; `futures`: the receiver's expectations of them."""
    await peer.start()
    assert (await peer.line())["ready"]
    sender_side = await peer.lines(len(plan))
    await asyncio.wait_for(asyncio.gather(*futures), 30)
    assert all(r["ok"] for r in sender_side), sender_side
    assert await peer.wait() == 0
    check_bit_exact(receiver.kv.tensor, make_kv(KVLayout(**peer.spec["layout"]), src_blocks,
                                                peer.spec["seed"]), plan)
    receiver.table.check_integrity()


def check_bit_exact(kv: torch.Tensor, src: torch.Tensor, plan: list[dict[str, Any]]) -> None:
    """Every write of `plan` (its "src" and "dst" regions as lists) landed bit for bit,
    and no byte outside them."""
    touched = torch.zeros(kv.shape[:2], dtype=torch.bool)
    for t in plan:
        for src_regions, dst_regions in zip(t["src"], t["dst"], strict=True):
            for s, d in zip(src_regions, dst_regions, strict=True):
                ls, le = (s[1], s[2]) if len(s) > 1 else (0, kv.shape[1])
                got = kv[d[0], ls:le].view(torch.uint8) if kv.dtype != torch.bfloat16 \
                    else kv[d[0], ls:le].view(torch.int16)
                want = src[s[0], ls:le].view(got.dtype)
                assert torch.equal(got, want), f"{t['xfer']}: block {d[0]} differs"
                touched[d[0], ls:le] = True
    assert not kv[~touched].any(), "bytes landed outside the destination regions"


class Gate:
    """A chunk's `Ready` (as torch.cuda.Event has it) that the test opens; opened on
    leaving its `with` too, so a failed check leaves no copy thread waiting on it."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def query(self) -> bool:
        return self.event.is_set()

    def synchronize(self) -> None:
        self.event.wait(10)

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.event.set()


@contextlib.asynccontextmanager
async def connected(config: TransferConfig, layout: KVLayout, dst_blocks: int, src_blocks: int,
                    seed: int) -> AsyncIterator[tuple[Any, Any, Any]]:
    """A started receiver of `dst_blocks` and a sender of `src_blocks` (seeded) connected
    to it: (receiver, sender, peer); both closed on the way out."""
    async with receiving(config, layout, dst_blocks) as receiver:
        sender = start_sender(config, layout, src_blocks, seed)
        try:
            yield receiver, sender, await sender.connect(receiver.address())
        finally:
            await sender.close()


async def until(condition: Callable[[], Any], timeout: float = 5.0) -> None:
    """Returns once `condition()` holds, looking every 10 ms; TimeoutError past `timeout`."""
    async with wire.deadline(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def stop_heartbeat(peer: Any) -> None:
    """Cancels the sender's heartbeat to `peer` (`SenderBase.connect`'s second task): no
    PING from now on, the connection otherwise intact."""
    heartbeat = peer.tasks[1]
    assert heartbeat.get_coro().__qualname__.endswith("._heartbeat"), peer.tasks
    heartbeat.cancel()


def open_sockets(ignore_listening: bool = False) -> int:
    """Sockets this process holds; optionally not counting TCP listeners (see ucx)."""
    listening: set[str] = set()
    if ignore_listening:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                listening |= {cols[9] for cols in (line.split() for line in f)
                              if len(cols) > 9 and cols[3] == "0A"}
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += link.startswith("socket:") and link[8:-1] not in listening
    return n


def shm_segments() -> set[str]:
    """The KV segments (kvtransfer/shm.py names them after the creating process) made by
    this process or a peer it started; other test processes on the machine may be
    making theirs meanwhile."""
    ours = {os.getpid(), *SPAWNED_PIDS}
    return {n for n in os.listdir("/dev/shm")
            if n.startswith("splitserve-kv-") and n.split("-")[2].isdigit()
            and int(n.split("-")[2]) in ours}
