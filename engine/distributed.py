"""Tensor-parallel process group: rank 0 (the engine's process) spawns ranks 1..N-1
(engine/tp_ranks.py) and joins them in one process group, gloo on CPU and NCCL on
CUDA, every collective bounded by the collective timeout.

Failure is all or nothing: a rank that dies or hangs takes the worker down whole.
Rank 0 watches its ranks' processes and exits the moment one ends; a collective that
outlasts the timeout ends the process that waited on it; a rank exits when rank 0's
process is gone (its command pipe closes). A supervisor then restarts the worker; no
rank is left waiting on a peer that will never answer.

The group is a torch ProcessGroup object of its own, not torch.distributed's default
group, so one process can hold more than one engine (tests) and nothing global leaks.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

log = logging.getLogger(__name__)

# Exit status of a process that a failed peer took down.
TP_FAILURE_EXIT = 70
# How long the rendezvous waits for ranks to start (import torch, load their shards):
# a rank that dies meanwhile ends rank 0 at once anyway (TPGroup.watch).
START_TIMEOUT_S = 600.0


_fatal_once = threading.Lock()


def fatal(message: str) -> None:
    """Ends this process at once: a tensor-parallel peer failed and the rest of the
    group cannot go on (a collective would wait on it forever). The first failure
    noticed (the watch, or a collective that failed) says why; a second waits for it."""
    if not _fatal_once.acquire(blocking=False):
        threading.Event().wait()
    log.critical("%s; the worker goes down whole", message)
    logging.shutdown()
    os._exit(TP_FAILURE_EXIT)


def make_group(store: Any, rank: int, size: int, device: torch.device) -> Any:
    """The group, its own timeout the start's (its rendezvous waits on ranks still
    loading); every collective passes the collective timeout itself."""
    timeout = timedelta(seconds=START_TIMEOUT_S)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


@dataclass
class TPGroup:
    """One rank's view of the group and its collectives. A collective that fails
    (a peer gone, or the timeout) ends the process (`fatal`)."""

    rank: int
    size: int
    device: torch.device
    pg: Any
    timeout_s: float
    # rank 0 only: the command pipe to each rank 1..N-1 and its process
    pipes: list[Connection] = field(default_factory=list)
    procs: list[Any] = field(default_factory=list)
    closing: bool = False
    store: Any = None  # the rendezvous store, kept alive with the group
    root_pid: int = 0  # rank 0's process and the rendezvous port name the group's
    port: int = 0  # KV segments (engine/rank_segments.py)

    @property
    def segments(self) -> list[str]:
        """Every rank's KV segment name (CPU; engine/rank_segments.py)."""
        from engine.rank_segments import segment_names

        return segment_names(self.root_pid, self.port, self.size)

    def unlink_segments(self) -> None:
        """Removes every rank's KV segment name: the group is going away."""
        if self.device.type == "cpu":
            from engine.rank_segments import unlink_segments

            unlink_segments(self.segments)

    def _wait(self, work: Any, what: str) -> None:
        # NCCL: `wait()` without a timeout only makes the current stream wait (no host
        # sync), so a collective can be captured in a CUDA graph; the op's own timeout
        # (`_opts`) is the watchdog's.
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001  (gloo raises RuntimeError, NCCL DistBackendError)
            self._fail(what, e)

    def _fail(self, what: str, error: object) -> None:
        self.closing = True
        for proc in self.procs:  # rank 0: a hung rank goes too (SIGKILL ends it stopped)
            proc.kill()
        self.unlink_segments()
        fatal(f"tensor-parallel rank {self.rank}: {what} failed "
              f"(collective timeout {self.timeout_s:g}s): {error}")

    def sync(self, what: str) -> None:
        """Waits for the work queued on this rank's current CUDA stream, at most the
        collective timeout: the collectives of a replayed CUDA graph are not the NCCL
        watchdog's to time. Polls an event (a blocking sync could not give up)."""
        if self.device.type != "cuda":
            return
        event = torch.cuda.Event()
        event.record()
        deadline = time.monotonic() + self.timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                self._fail(what, "timed out")
            time.sleep(20e-6)

    def _opts(self, kind: Any) -> Any:
        opts = kind()
        opts.timeout = timedelta(seconds=self.timeout_s)
        return opts

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._wait(self.pg.allreduce([t], self._opts(dist.AllreduceOptions)), "all-reduce")
        return t

    def all_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        opts = self._opts(dist.AllreduceOptions)
        opts.reduceOp = dist.ReduceOp.MIN
        self._wait(self.pg.allreduce([t], opts), "all-reduce")
        return t

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        opts = self._opts(dist.BroadcastOptions)
        opts.rootRank = root
        self._wait(self.pg.broadcast([t], opts), "broadcast")
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` concatenated along `dim`, in rank order."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        opts = self._opts(AllgatherOptions)
        self._wait(self.pg.allgather([parts], [t], opts), "all-gather")
        return torch.cat(parts, dim=dim)

    # -- rank 0: commands to the other ranks ------------------------------------------
    def send(self, command: tuple) -> None:
        """A command for every other rank (engine/tp_ranks.py reads them in order)."""
        for p in self.pipes:
            try:
                p.send(command)
            except OSError as e:
                self.unlink_segments()
                fatal(f"tensor-parallel rank gone ({e})")

    def close(self, timeout_s: float = 10.0) -> None:
        """Stops ranks 1..N-1 (rank 0, when its engine is done)."""
        if self.closing:
            return
        self.closing = True
        for p in self.pipes:
            try:
                p.send(("exit",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout_s)
        for p in self.pipes:
            p.close()
        self.unlink_segments()

    def watch(self) -> None:
        """Rank 0: a thread that ends this process when a rank's process ends
        unasked (killed, crashed, or out of memory)."""
        def run() -> None:
            sentinels = {p.sentinel: (i + 1, p) for i, p in enumerate(self.procs)}
            ready = wait(list(sentinels))
            if self.closing:
                return
            dead = []
            for s in ready:
                rank, proc = sentinels[s]
                proc.join(1.0)
                dead.append((rank, proc.exitcode))
            for proc in self.procs:
                if proc.is_alive():
                    proc.kill()
            self.unlink_segments()
            fatal("tensor-parallel rank(s) exited: " + ", ".join(
                f"rank {r} (exit code {code})" for r, code in dead))

        threading.Thread(target=run, name="tp-watch", daemon=True).start()


def share_cpu_threads(device: torch.device, size: int) -> None:
    """On CPU the ranks share the host's cores: each takes its share of intra-op
    threads (oversubscribed, a rank's spinning threads starve the peer it waits on)."""
    if device.type == "cpu":
        share = max(1, (os.cpu_count() or 1) // size)
        if torch.get_num_threads() > share:
            torch.set_num_threads(share)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th after the engine's own (cuda -> cuda:r); CPU for all."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def start_group(config: Any, device: torch.device) -> TPGroup:
    """Rank 0: spawns ranks 1..N-1 for `config` (an EngineConfig) and joins them."""
    size = config.tensor_parallel_size
    if device.type == "cuda":
        need = (device.index or 0) + size
        if torch.cuda.device_count() < need:
            raise ValueError(f"tensor parallel size {size} on {device} needs {need} visible "
                             f"GPUs; {torch.cuda.device_count()} visible")
    store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False,
                          timeout=timedelta(seconds=START_TIMEOUT_S))
    from engine import tp_ranks

    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(1, size):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=tp_ranks.rank_main, name=f"splitserve-tp{rank}",
                           args=(config, rank, store.port, theirs, os.getpid()),
                           daemon=True)
        proc.start()
        theirs.close()
        pipes.append(ours)
        procs.append(proc)
    group = TPGroup(0, size, device, None, config.collective_timeout_s, pipes, procs,
                    root_pid=os.getpid(), port=store.port)
    # At exit, ranks are stopped on purpose (before multiprocessing's own exit hook,
    # registered earlier, terminates them: the watch would take that for a failure).
    atexit.register(group.close)
    group.watch()  # before the rendezvous: a rank that fails to start ends it too
    group.pg = make_group(store, 0, size, device)
    group.store = store
    return group


def join_group(config: Any, rank: int, port: int, device: torch.device,
               root_pid: int) -> TPGroup:
    """Ranks 1..N-1: joins rank 0's group (rank 0's process is `root_pid`)."""
    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, False,
                          timeout=timedelta(seconds=START_TIMEOUT_S))
    pg = make_group(store, rank, config.tensor_parallel_size, device)
    group = TPGroup(rank, config.tensor_parallel_size, device, pg, config.collective_timeout_s,
                    store=store, root_pid=root_pid, port=port)
    return group
