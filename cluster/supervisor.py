"""Supervisor: starts child processes, restarts those that exit, gives up on crash loops.

One mechanism for every child (Redis, workers, the gateway): a child is its argv, its
environment and its log file, so a restart is the same command again — Redis comes back
on the same port with the same flags, a worker with the same id and ports (the gateway's
registry finds it again under its id), the gateway on the same ports.

Ownership: the supervisor owns every process it starts. Each child runs in its own
process group and, on Linux, gets SIGTERM when the thread that spawned it dies
(PR_SET_PDEATHSIG is per thread), so `poll()` must run on a thread that lives as long
as the cluster — `splitserve up` calls it from its main thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from cluster.errors import CrashLoopError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    reset_after_s: float = 30.0  # a child up this long restarts after backoff_initial_s again
    max_restarts: int = 5  # restarts of one child within window_s; one more exit is fatal
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        if self.reset_after_s <= 0 or self.window_s <= 0:
            raise ValueError("reset_after_s and window_s must be > 0")
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0 (0: any exit stops the cluster)")

    def next_delay(self, last_delay_s: float | None, uptime_s: float) -> float:
        """Seconds to wait before restarting a child that exited after `uptime_s`, when
        its previous restart waited `last_delay_s` (None: never restarted)."""
        if last_delay_s is None or uptime_s >= self.reset_after_s:
            return self.backoff_initial_s
        return min(last_delay_s * 2, self.backoff_max_s)


@dataclass(slots=True)
class Child:
    """One supervised process. `proc` is replaced on restart; the object (and so every
    reference a caller holds) stays the same."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: str
    proc: subprocess.Popen[bytes]
    grpc_address: str | None = None  # health-checked for readiness
    extra: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    wanted: bool = True  # False once stopped on purpose: never restarted
    started_at: float = field(default_factory=time.monotonic)
    last_exit: str = ""

    def log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
        return ""


@dataclass(slots=True)
class _Backoff:
    """Restart bookkeeping for one child; owned by the Supervisor."""

    delay_s: float | None = None  # the last restart's wait
    due: float | None = None  # set while the child waits out its backoff
    history: deque[float] = field(default_factory=deque)  # restart times in the window


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class Supervisor:
    def __init__(self, policy: RestartPolicy, cwd: str | None = None) -> None:
        self.policy = policy
        self.cwd = cwd
        self.children: list[Child] = []
        self._backoff: dict[str, _Backoff] = {}

    # -- starting ----------------------------------------------------------------------
    def start(self, name: str, argv: list[str], env: dict[str, str], log_path: str,
              grpc_address: str | None = None) -> Child:
        """Starts `argv` as child `name` (a fresh log at `log_path`) and supervises it."""
        if any(c.name == name for c in self.children):
            raise ValueError(f"a child named {name!r} already exists")
        child = Child(name, list(argv), dict(env), log_path, self._popen(argv, env, log_path,
                                                                         "wb"), grpc_address)
        self.children.append(child)
        self._backoff[name] = _Backoff()
        return child

    def _popen(self, argv: list[str], env: dict[str, str], log_path: str,
               mode: str) -> subprocess.Popen[bytes]:
        with open(log_path, mode) as out:
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=self.cwd, preexec_fn=_die_with_parent)

    def restarts(self) -> dict[str, int]:
        return {c.name: c.restarts for c in self.children}

    def status(self) -> list[dict[str, Any]]:
        """What `status.json` shows: one entry per child."""
        return [{"name": c.name, "pid": c.proc.pid, "running": c.proc.poll() is None,
                 "restarts": c.restarts, "last_exit": c.last_exit, "log": c.log_path,
                 "grpc_address": c.grpc_address} for c in self.children]

    # -- supervising -------------------------------------------------------------------
    def poll(self) -> bool:
        """One supervision round: notes children that exited (scheduling their restart
        after a backoff) and restarts those whose backoff is over. True when anything
        changed. Raises CrashLoopError when a child exits more than the policy allows;
        stopping the other children is then the caller's job."""
        now = time.monotonic()
        changed = False
        for child in self.children:
            if not child.wanted:
                continue
            b = self._backoff[child.name]
            if b.due is None and child.proc.poll() is not None:
                self._on_exit(child, b, now)
                changed = True
            elif b.due is not None and now >= b.due:
                self._restart(child, b, now)
                changed = True
        return changed

    def _on_exit(self, child: Child, b: _Backoff, now: float) -> None:
        uptime = now - child.started_at
        child.last_exit = describe_exit(child.proc.returncode)
        # Whatever the child left in its process group (a wrapper's own children) would
        # hold its ports against the restart.
        _kill_group(child.proc.pid, signal.SIGKILL)
        while b.history and now - b.history[0] > self.policy.window_s:
            b.history.popleft()
        if len(b.history) >= self.policy.max_restarts:
            raise CrashLoopError(child.name, child.log_path, (
                f"{child.name} keeps exiting ({child.last_exit} after {uptime:.1f} s; "
                f"{len(b.history)} restart(s) within {self.policy.window_s:g} s): stopping "
                f"the cluster. Its log ({child.log_path}) ends:\n{child.log_tail()}"))
        b.delay_s = self.policy.next_delay(b.delay_s, uptime)
        b.due = now + b.delay_s
        log.warning("%s (pid %d) exited: %s after %.1f s; restart #%d in %.2f s (log: %s)",
                    child.name, child.proc.pid, child.last_exit, uptime, child.restarts + 1,
                    b.delay_s, child.log_path)

    def _restart(self, child: Child, b: _Backoff, now: float) -> None:
        b.due = None
        b.history.append(now)
        child.restarts += 1
        with open(child.log_path, "ab") as f:  # one log per child across restarts
            f.write(f"\n=== splitserve up: restart #{child.restarts} of {child.name} "
                    f"(previous run: {child.last_exit}) ===\n".encode())
        child.proc = self._popen(child.argv, child.env, child.log_path, "ab")
        child.started_at = now
        log.warning("%s restarted (pid %d, restart #%d)", child.name, child.proc.pid,
                    child.restarts)

    # -- stopping ----------------------------------------------------------------------
    def stop(self, child: Child, sig: int = signal.SIGTERM, timeout_s: float = 15.0
             ) -> int | None:
        """Stops `child` for good (it is not restarted): `sig` to its process group, then
        SIGKILL after `timeout_s`. Returns its exit code."""
        self.stop_all([child], sig, timeout_s)
        return child.proc.returncode

    def stop_all(self, children: list[Child], sig: int = signal.SIGTERM,
                 timeout_s: float = 15.0) -> None:
        """Stops `children` for good, together: `sig` to each one's process group, then
        each gets until `timeout_s` from now to exit before SIGKILL, so they drain at the
        same time rather than one after another."""
        running = []
        for child in children:
            child.wanted = False
            self._backoff[child.name].due = None
            if child.proc.poll() is None:
                _kill_group(child.proc.pid, sig)
                running.append(child)
        deadline = time.monotonic() + timeout_s
        for child in running:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # Leftovers of its group, if any; only right after the wait, while its pid
            # cannot have been reused.
            _kill_group(child.proc.pid, signal.SIGKILL)
            child.proc.wait(5.0)
