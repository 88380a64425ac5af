"""Supervisor logic with fake children (`sh -c ...`): restart with backoff, counted and
logged; crash loops stop with an error naming the child and its log; stopped children
stay stopped. Every loop is bounded by a deadline."""

from __future__ import annotations

import os
import signal
import time

import pytest

from cluster.errors import CrashLoopError
from cluster.supervisor import RestartPolicy, Supervisor, describe_exit

FAST = RestartPolicy(backoff_initial_s=0.02, backoff_max_s=0.05, reset_after_s=30,
                     max_restarts=3, window_s=30)


def make_supervisor(policy: RestartPolicy = FAST) -> Supervisor:
    return Supervisor(policy)


def start(sup: Supervisor, tmp_path, name: str, script: str):
    return sup.start(name, ["sh", "-c", script], dict(os.environ), str(tmp_path / f"{name}.log"))


def poll_until(sup: Supervisor, cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, sup.status()
        sup.poll()
        time.sleep(0.01)


def runs(child) -> int:
    """How many times the child's script began: its "run" lines in the log."""
    with open(child.log_path) as f:
        return f.read().splitlines().count("run")


def test_backoff_doubles_to_the_cap_and_resets_after_a_long_run() -> None:
    p = RestartPolicy(backoff_initial_s=0.5, backoff_max_s=10, reset_after_s=30)
    delays, last = [], None
    for _ in range(7):
        last = p.next_delay(last, uptime_s=1.0)
        delays.append(last)
    assert delays == [0.5, 1, 2, 4, 8, 10, 10]
    assert p.next_delay(10, uptime_s=31.0) == 0.5  # it stayed up: a fresh failure


def test_policy_errors() -> None:
    with pytest.raises(ValueError):
        RestartPolicy(backoff_initial_s=2, backoff_max_s=1)
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)


def test_killed_child_is_restarted_with_the_same_command_and_log(tmp_path, caplog) -> None:
    sup = make_supervisor()
    child = start(sup, tmp_path, "svc", "echo run; exec sleep 30")
    first = child.proc.pid
    try:
        # Killed before its first line, the child would log "run" once in all.
        poll_until(sup, lambda: runs(child) == 1)
        os.kill(first, signal.SIGKILL)
        poll_until(sup, lambda: child.restarts == 1 and child.proc.poll() is None)
        assert child.proc.pid != first and child.last_exit == "killed by SIGKILL"
        assert sup.restarts() == {"svc": 1}
        poll_until(sup, lambda: runs(child) == 2)
        assert "restart #1 of svc" in open(child.log_path).read()
        assert "svc" in caplog.text and "killed by SIGKILL" in caplog.text
        assert child.log_path in caplog.text
        [entry] = sup.status()
        assert entry["restarts"] == 1 and entry["running"] and entry["pid"] == child.proc.pid
    finally:
        sup.stop(child, timeout_s=2)
    assert child.proc.poll() is not None


def test_child_that_always_exits_is_a_crash_loop_naming_it_and_its_log(tmp_path) -> None:
    sup = make_supervisor()
    ok = start(sup, tmp_path, "steady", "exec sleep 30")
    bad = start(sup, tmp_path, "flaky", "echo 'bad flag --nope'; exit 3")
    try:
        with pytest.raises(CrashLoopError) as ei:
            poll_until(sup, lambda: False)
        assert ei.value.name == "flaky" and ei.value.log_path == bad.log_path
        msg = str(ei.value)
        assert "flaky" in msg and bad.log_path in msg and "exit code 3" in msg
        assert "bad flag --nope" in msg  # the log's tail, so the cause is on screen
        assert bad.restarts == FAST.max_restarts and ok.restarts == 0
    finally:
        for c in sup.children:
            sup.stop(c, timeout_s=2)


def test_max_restarts_zero_makes_any_exit_fatal(tmp_path) -> None:
    sup = make_supervisor(RestartPolicy(max_restarts=0))
    start(sup, tmp_path, "once", "exit 0")
    with pytest.raises(CrashLoopError, match="once"):
        poll_until(sup, lambda: False)


def test_a_child_stopped_on_purpose_is_not_restarted(tmp_path) -> None:
    sup = make_supervisor()
    child = start(sup, tmp_path, "svc", "exec sleep 30")
    assert sup.stop(child, timeout_s=2) == -signal.SIGTERM
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        assert not sup.poll()
        time.sleep(0.02)
    assert child.restarts == 0


def test_children_stopped_together_drain_at_the_same_time(tmp_path) -> None:
    """Three children that each take a second to exit after SIGTERM: stopped together,
    the three seconds overlap; each exits on its own (exit 0), none is killed."""
    sup = make_supervisor()
    children = [start(sup, tmp_path, f"slow{i}", "trap 'sleep 1; exit 0' TERM; echo up; "
                      "while :; do sleep 0.05; done") for i in range(3)]
    deadline = time.monotonic() + 5
    while not all(os.path.getsize(c.log_path) for c in children):  # the traps are set
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    sup.stop_all(children, timeout_s=10)
    assert time.monotonic() - t0 < 2.5
    assert [c.proc.returncode for c in children] == [0, 0, 0]
    assert not any(c.wanted for c in children)


def test_stop_kills_what_the_child_left_in_its_group(tmp_path) -> None:
    """A wrapper whose own child ignores SIGTERM: nothing of the group survives stop."""
    sup = make_supervisor()
    pid_file = tmp_path / "grandchild.pid"
    child = start(sup, tmp_path, "wrapper",
                  f"sh -c 'trap \"\" TERM; echo $$ > {pid_file}; exec sleep 30' & wait")
    deadline = time.monotonic() + 5
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    grandchild = int(pid_file.read_text())
    sup.stop(child, timeout_s=2)
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{grandchild}") and "Z" not in _state(grandchild):
        assert time.monotonic() < deadline, "grandchild survived"
        time.sleep(0.02)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_describe_exit() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(2) == "exit code 2"
