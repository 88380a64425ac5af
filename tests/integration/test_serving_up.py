"""`splitserve up` as a user runs it: starts everything, answers the demo request,
stops cleanly on Ctrl-C (exit 0, every port closed: no orphans)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from cluster.launcher import ROOT, free_port
from tests.factories import child_env, tiny_model_dir
from tests.integration.serving_util import port_refused


def _run_up(*args: str) -> subprocess.Popen[str]:
    env = child_env(PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "cluster.cli", "up", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def descendants(root: int) -> set[str]:
    """`root` and every process under it: only their shared memory is looked at, as
    other test runs on the machine may be making theirs."""
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after "(comm)": state ppid
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(str(pid))
        todo += children.get(pid, [])
    return found


def test_up_demo_request_then_ctrl_c_stops_everything() -> None:
    """The default cluster (1 prefill + 1 decode), here over shm: nothing is left."""
    http, grpc_port = free_port(), free_port()
    proc = _run_up("--model", tiny_model_dir("llama"), "--transport", "shm", "--num-blocks",
                   "64", "--http-port", str(http), "--grpc-port", str(grpc_port),
                   "--demo-request")
    out = ""
    try:
        deadline = time.monotonic() + 150
        assert proc.stdout is not None
        while "KV moved" not in out and "prefilled this prompt itself" not in out:
            assert time.monotonic() < deadline, out
            line = proc.stdout.readline()
            assert line, f"splitserve up exited early:\n{out}"
            out += line
        assert f"http://127.0.0.1:{http}/v1" in out and f"127.0.0.1:{grpc_port}" in out
        assert '"completion_tokens": 24' in out
        # What the model produced is visible: its text and every generated token.
        assert '"text": ""' not in out and "generated tokens: [" in out
        assert "prefilled on a prefill worker" in out and "over shm" in out, out
        cluster_pids = descendants(proc.pid)  # `up` and the processes it started
        logs = re.search(r"logs: (\S+)\)", out)
        assert logs, out
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    worker_logs = [open(os.path.join(logs.group(1), f"{name}.log")).read()
                   for name in ("prefill-0", "decode-0")]
    ports = [int(re.search(r"listening on 127\.0\.0\.1:(\d+)", w).group(1))
             for w in worker_logs]
    ports.append(int(re.search(r'kv receiver listening: .*"port": (\d+)',
                               worker_logs[1]).group(1)))
    redis_port = int(re.search(r"redis://127\.0\.0\.1:(\d+)", out).group(1))
    for port in (http, grpc_port, redis_port, *ports):
        assert port_refused(port), f"port {port} still open after Ctrl-C"
    for w in worker_logs:
        assert "stopped" in w  # the worker drained and exited on its own
    left = [n for n in os.listdir("/dev/shm")
            if n.startswith("splitserve-kv-") and n.split("-")[2] in cluster_pids]
    assert not left, f"shared memory left behind: {left}"
