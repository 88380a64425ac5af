"""`splitserve up` supervises its children (real processes, a real redis-server):
Redis SIGKILLed -> restarted on the same port, every request before, during and after
succeeds with transformers' greedy output, the restart counted; a worker SIGKILLed ->
restarted under its id and routed to again; a child that fails on every restart -> the
cluster stops with exit 1 and an error naming it and its log; Ctrl-C after restarts
leaves no process and no open port behind."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.launcher import ROOT, free_port
from tests.factories import child_env, hf_greedy, hf_model, tiny_model_dir
from tests.integration.serving_util import admin, call_http, grpc_generate, port_refused, wait_for

pytestmark = pytest.mark.skipif(not any(
    os.access(os.path.join(d, "redis-server"), os.X_OK)
    for d in os.environ.get("PATH", "").split(os.pathsep)),
    reason="redis-server is not installed (make sysdeps)")

# Long enough that a request sent right after the kill provably runs while Redis is down.
REDIS_DOWN_S = 2.0
PROMPT = [(7 * j) % 500 + 1 for j in range(40)]
MAX_TOKENS = 8


class Up:
    """One `splitserve up` process; its output is read on a thread so the pipe never
    fills, and every pid it ever reported is remembered."""

    def __init__(self, *args: str) -> None:
        self.http = free_port()
        env = child_env(PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "up", "--model", tiny_model_dir("llama"),
             "--num-blocks", "64", "--http-port", str(self.http), "--grpc-port",
             str(free_port()), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.pids: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()
        wait_for(lambda: "splitserve is up" in self.out or self.proc.poll() is not None, 60,
                 "splitserve up to start")
        assert "splitserve is up" in self.out, self.out
        found = re.search(r"status \(pids, restarts\): (\S+)", self.out)
        assert found, self.out
        self.status_path = found.group(1)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def status(self) -> dict[str, Any]:
        with open(self.status_path) as f:
            st: dict[str, Any] = json.load(f)
        self.pids |= {c["pid"] for c in st["children"]}
        return st

    def child(self, name: str) -> dict[str, Any]:
        return next(c for c in self.status()["children"] if c["name"] == name)

    def generate(self, prompt: list[int]) -> list[int]:
        """Greedy token ids through the gateway's gRPC Generate."""
        address = f"127.0.0.1:{self.status()['grpc_port']}"
        return asyncio.run(grpc_generate(address, [prompt], [MAX_TOKENS], timeout=30))[0]

    def complete(self, prompt: str) -> str:
        got, body, _ = call_http(self.http, "POST", "/v1/completions", {
            "prompt": prompt, "max_tokens": 8, "temperature": 0}, timeout=30)
        assert got == 200, (body, self.out[-3000:])
        return str(body["choices"][0]["text"])

    def routable(self, worker_id: str) -> bool:
        got, snap, _ = call_http(self.http, "GET", "/debug/workers", headers=admin(),
                                 timeout=5)
        return got == 200 and any(w["worker_id"] == worker_id and w["routable"] for w in snap)

    def ports(self) -> list[int]:
        st = self.status()
        addrs = [c["grpc_address"] for c in st["children"] if c["grpc_address"]]
        return [self.http, st["grpc_port"], int(st["redis_url"].rsplit(":", 1)[1]),
                *(int(a.rsplit(":", 1)[1]) for a in addrs)]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # dead, not yet reaped
    except OSError:
        return True


def _redis_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _assert_nothing_left(up: Up, ports: list[int]) -> None:
    wait_for(lambda: all(_gone(p) for p in up.pids), 10, f"children {up.pids} to be gone")
    for port in ports:
        assert port_refused(port), f"port {port} still open"


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    cluster = Up("--colocated", "2", "--restart-backoff", str(REDIS_DOWN_S))
    try:
        yield cluster
    finally:
        cluster.kill()


@pytest.fixture(scope="module")
def expected() -> list[int]:
    hf = hf_model(tiny_model_dir("llama"))
    eos = hf.generation_config.eos_token_id
    return hf_greedy(hf, PROMPT, MAX_TOKENS, eos[0] if isinstance(eos, list) else eos)


def test_redis_sigkilled_is_restarted_on_its_port_and_no_request_fails(
        up: Up, expected: list[int]) -> None:
    assert up.generate(PROMPT) == expected
    redis = up.child("redis")
    port = int(up.status()["redis_url"].rsplit(":", 1)[1])
    os.kill(redis["pid"], signal.SIGKILL)
    wait_for(lambda: not _redis_ping(port), 5, "redis down")
    for _ in range(2):  # Redis is advisory: load-only routing meanwhile
        assert up.generate(PROMPT) == expected
    assert up.child("redis")["restarts"] == 0, "the requests did not run during the outage"
    wait_for(lambda: up.child("redis")["restarts"] == 1 and _redis_ping(port), 10,
             "redis restarted on its port")
    assert up.child("redis")["pid"] != redis["pid"]
    for _ in range(3):
        assert up.generate(PROMPT) == expected
    # The workers register again in the new (empty) Redis, so discovery still works.
    wait_for(lambda: up.routable("colocated-0") and up.routable("colocated-1"), 15,
             "both workers routable after the Redis restart")
    log = next(line for line in up.lines if "redis (pid" in line and "exited" in line)
    assert "killed by SIGKILL" in log and "restart #1" in log and redis["log"] in log


def test_worker_sigkilled_is_restarted_under_its_id_and_serves_again(
        up: Up, expected: list[int]) -> None:
    victim = up.child("colocated-1")
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: up.child("colocated-1")["restarts"] == 1, 10, "the worker restarted")
    after = up.child("colocated-1")
    assert after["grpc_address"] == victim["grpc_address"] and after["pid"] != victim["pid"]
    wait_for(lambda: up.routable("colocated-1"), 30, "the restarted worker routable again")
    for i in range(4):  # load routing spreads these over both workers
        up.complete(f"after the worker restart {i}")
    assert up.generate(PROMPT) == expected
    assert "restart #1 of colocated-1" in open(after["log"]).read()
    assert up.child("colocated-0")["restarts"] == 0


def test_ctrl_c_after_restarts_stops_every_process_and_frees_every_port(up: Up) -> None:
    ports = up.ports()
    up.status()
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(60) == 0, up.out[-3000:]
    _assert_nothing_left(up, ports)


def test_child_failing_on_every_restart_stops_the_cluster_naming_it() -> None:
    """Redis is killed and its port taken by someone else: each restart exits at once
    (address in use) until the crash-loop limit stops everything, exit code 1."""
    up = Up("--colocated", "1", "--max-restarts", "2", "--restart-backoff", "0.3")
    squatter = socket.socket()
    try:
        ports = up.ports()
        redis = up.child("redis")
        os.kill(redis["pid"], signal.SIGKILL)
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        wait_for(lambda: _try_bind(squatter, ports[2]), 5, "the redis port to be free")
        squatter.listen()
        assert up.proc.wait(30) == 1, up.out[-3000:]
        out = up.out
        assert "error: redis keeps exiting" in out and redis["log"] in out, out[-3000:]
        assert "Address already in use" in out  # the log's tail says why
        assert up.child("redis")["restarts"] == 2
        _assert_nothing_left(up, [p for p in ports if p != ports[2]])
    finally:
        squatter.close()
        up.kill()


def _try_bind(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
