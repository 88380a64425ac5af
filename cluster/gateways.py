"""Several gateways on one local cluster: their ports, the admin key they share, and
whether each one routes to the workers.

N gateways listen on consecutive HTTP and gRPC ports (a load balancer's backend list is
then one range) and share one Redis (block index, worker registry, scheduling
strategies); admission stays per gateway. They share one admin key, which the launcher
hands them through the environment ($SPLITSERVE_ADMIN_KEY, never argv, so `ps` does not
show it) and uses for its own readiness checks (`/debug/workers` is an admin route).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import urllib.error
import urllib.request
from typing import Any


def gateway_name(index: int) -> str:
    """The first gateway is `gateway` (as with one), the others `gateway-1`, ..."""
    return "gateway" if index == 0 else f"gateway-{index}"


def is_gateway(name: str) -> bool:
    return name == "gateway" or name.startswith("gateway-")


def consecutive_ports(host: str, base: int, n: int) -> list[int]:
    """`n` ports from `base` on, or (base 0) a run of `n` free consecutive ports."""
    from cluster.launcher import free_port  # (the launcher imports this module)

    if base:
        return [base + i for i in range(n)]
    for _ in range(200):
        first = free_port(host)
        run = [first]
        for port in range(first + 1, first + n):
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    break
            run.append(port)
        if len(run) == n:
            return run
    raise OSError(f"no {n} consecutive free ports on {host}")


def admin_key(gateway_args: tuple[str, ...], env_key: str | None) -> str:
    """The key of the gateways' admin API: `--admin-key` in gateway_args when the caller
    chose one there, else the launcher's $SPLITSERVE_ADMIN_KEY (`env_key`), else a fresh
    one."""
    args = list(gateway_args)
    for i, a in enumerate(args):
        if a == "--admin-key" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--admin-key="):
            return a.split("=", 1)[1]
    return env_key or secrets.token_hex(16)


def admin_headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def debug_workers(host: str, port: int, key: str, timeout_s: float = 2.0
                  ) -> list[dict[str, Any]]:
    """One gateway's `/debug/workers`. Raises OSError (urllib's errors among them) when
    it does not answer 200."""
    req = urllib.request.Request(f"http://{host}:{port}/debug/workers",
                                 headers=admin_headers(key))
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        out: list[dict[str, Any]] = json.loads(resp.read())
    return out


def routable_addresses(host: str, port: int, key: str) -> set[str] | None:
    """The worker addresses one gateway routes to now; None when it does not answer."""
    with contextlib.suppress(OSError, ValueError):
        return {w["address"] for w in debug_workers(host, port, key) if w["routable"]}
    return None


def env_admin_key() -> str | None:
    return os.environ.get("SPLITSERVE_ADMIN_KEY") or None


def write_private(path: str, text: str) -> None:
    """`text` into a file only its owner can read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
