"""Helpers for the serving tests: plain HTTP calls, worker load reports, metrics."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc

from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from protos.auth import signed_metadata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def splitserve_cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`splitserve ARGS` (as `python -m cluster.cli`, from the repository root) to its
    end; fails the test with the tail of its output unless it exits 0."""
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def admin(key: str | None = None) -> dict[str, str]:
    """The Authorization header of the admin routes (`/debug/workers`): `key` (a
    LocalCluster's `admin_key`), else the test session's admin key (tests/conftest.py;
    LocalCluster hands it to its gateways unless their args name another)."""
    return {"Authorization": f"Bearer {key or os.environ.get('SPLITSERVE_ADMIN_KEY', '')}"}


def call_http(port: int, method: str, path: str, body: bytes | dict | None = None,
         headers: dict[str, str] | None = None, timeout: float = 60.0,
         ) -> tuple[int, Any, dict[str, str]]:
    """(status, parsed JSON body or raw text, headers); never raises on 4xx/5xx."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                       **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        hdrs = {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()
    try:
        parsed: Any = json.loads(raw) if raw else None
    except ValueError:
        parsed = raw.decode(errors="replace")
    return resp.status, parsed, hdrs


def ttft_parts(header: str) -> dict[str, float]:
    """`x-splitserve-ttft` ("queue;dur=0.12, route;dur=0.40, ...") as {part: ms}."""
    out = {}
    for item in header.split(","):
        name, _, dur = item.strip().partition(";dur=")
        out[name] = float(dur)
    return out


def load_report(address: str, timeout: float = 3.0) -> pb.LoadReport:
    """A worker's first load report, signed with the test session's cluster token
    (tests/conftest.py; LocalCluster hands it to every child)."""
    md = signed_metadata(os.environ.get("SPLITSERVE_CLUSTER_TOKEN", ""),
                         "/splitserve.v1.Worker/Load")
    with grpc.insecure_channel(address) as ch:
        call = pb_grpc.WorkerStub(ch).Load(pb.LoadRequest(min_interval_ms=50), timeout=timeout,
                                           metadata=md)
        try:
            return next(iter(call))
        finally:
            call.cancel()


def wait_for(cond: Callable[[], bool], timeout: float, what: str, every: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def metric(port: int, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


async def grpc_generate(address: str, prompts: list[list[int]], max_tokens: list[int],
                        timeout: float = 120.0) -> list[list[int]]:
    """Greedy token ids of each prompt through the gateway's gRPC Generate, concurrently."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.GenerateStub(ch)

        async def one(p: list[int], m: int) -> list[int]:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingParams(
                max_tokens=m, temperature=0.0))
            out: list[int] = []
            async for r in stub.Generate(req, timeout=timeout):
                out += r.token_ids
            return out
        return list(await asyncio.gather(*(one(p, m) for p, m in zip(prompts, max_tokens))))


def stream_then_hang_up(port: int, body: dict[str, Any], events: int) -> None:
    """POSTs a streaming completion over a raw socket, reads `events` SSE events, then
    closes the connection mid-stream (a client that went away)."""
    data = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(data)).encode()
                  + b"\r\n\r\n" + data)
        seen = b""
        while seen.count(b"data: ") < events:
            chunk = s.recv(4096)
            assert chunk, "stream ended early"
            seen += chunk


def port_refused(port: int) -> bool:
    """True when nothing accepts connections on 127.0.0.1:`port` (a stopped server)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return False
    except OSError:
        return True
