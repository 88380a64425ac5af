"""LocalCluster: redis-server, workers and the gateways as child processes on one host.

Ownership: the cluster owns every child it starts, through its Supervisor. Each child
runs in its own process group (a terminal's Ctrl-C reaches only the launcher, which then
stops children in order: gateways, prefill workers, the other workers, redis) and, on
Linux, gets SIGTERM if the launcher dies, so no orphans are left. Children are started
through their public command line (`python -m cluster.cli worker|gateway ...`), never
imported.

Start-up is strict (a child that dies before the cluster is ready is an error). After
that, `supervise()` — called in a loop by `splitserve up` — restarts children that exit
(see cluster/supervisor.py); a LocalCluster nobody supervises leaves exited children
down, which is what tests that stop a child on purpose rely on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from cluster.errors import ClusterError, CrashLoopError, PortTakenError
from cluster.gateways import (
    admin_key,
    consecutive_ports,
    env_admin_key,
    gateway_name,
    is_gateway,
    routable_addresses,
    write_private,
)
from cluster.supervisor import Child, RestartPolicy, Supervisor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRANSPORTS = ("ucx", "tcp", "shm", "cuda_ipc", "auto")
# Re-exported: callers import these from the launcher.
__all__ = ["Child", "ClusterError", "ClusterSpec", "CrashLoopError", "LocalCluster",
           "RestartPolicy", "free_port"]


log = logging.getLogger(__name__)
_RANDOM = random.SystemRandom()  # (not the module's generator, which tests may seed)
_HANDED: set[int] = set()  # the ports this process handed out
_LOWEST_PORT = 10000
_PORT_TAKEN = "Address already in use"  # what a child (and redis-server) logs then
_START_TRIES = 3


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on or holds now, for a child to bind, chosen below the
    kernel's ephemeral range: a port from that range (what binding port 0 gives) can be
    taken by any outgoing connection on the machine, whose connect() binds one, before
    the child binds it (CI saw a worker's metrics port taken that way). Not one this
    process handed out before. Falls back to the kernel's choice when the range below
    is too small or full."""
    top = _ephemeral_start()
    if top - _LOWEST_PORT >= 1000:
        for _ in range(100):
            port = _RANDOM.randrange(_LOWEST_PORT, top)
            if port in _HANDED:
                continue
            with socket.socket() as s, contextlib.suppress(OSError):
                s.bind((host, port))  # (no SO_REUSEADDR: a port in TIME_WAIT fails too)
                _HANDED.add(port)
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    model_dir: str
    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 1
    transport: str = "tcp"
    host: str = "127.0.0.1"
    http_port: int = 0  # 0: a free port
    grpc_port: int = 0
    worker_args: tuple[str, ...] = ()  # extra flags for every worker (engine knobs)
    gateway_args: tuple[str, ...] = ()
    num_gateways: int = 1  # on consecutive ports from http_port / grpc_port
    ready_timeout_s: float = 180.0
    stop_timeout_s: float = 15.0
    log_dir: str | None = None  # None: a fresh temporary directory
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    # worker id -> its cluster.placement.WorkerPlacement (TP size, GPUs); none: defaults
    placement: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if min(self.num_prefill, self.num_decode, self.num_colocated) < 0:
            raise ValueError("worker counts must be >= 0")
        if self.num_decode + self.num_colocated == 0:
            raise ValueError("need at least one decode or colocated worker")
        if self.num_prefill and not self.num_decode:
            raise ValueError("prefill workers need at least one decode worker to write into")
        if self.num_gateways < 1:
            raise ValueError("need at least one gateway")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}")


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.log_dir = spec.log_dir or tempfile.mkdtemp(prefix="splitserve-up-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.supervisor = Supervisor(spec.restart, cwd=ROOT)
        self.children: list[Child] = self.supervisor.children  # the same list
        self.status_path = os.path.join(self.log_dir, "status.json")
        self.redis_url = ""
        # The cluster secret every child is given (environment only, never argv, so `ps`
        # does not show it): KV-transfer handshakes and signed worker RPCs (workers check,
        # the gateway signs). The launcher's own $SPLITSERVE_CLUSTER_TOKEN if set (a
        # client of the workers then knows it), else a fresh one.
        self.cluster_token = os.environ.get("SPLITSERVE_CLUSTER_TOKEN") or \
            secrets.token_hex(16)
        # The gateways' admin key (cluster/gateways.py): the environment carries it to
        # them, like the cluster token; /debug/workers, which readiness reads, needs it.
        self.admin_key = admin_key(spec.gateway_args, env_admin_key())
        self.admin_key_path = os.path.join(self.log_dir, "admin_key")  # 0600, for operators
        self._choose_gateway_ports()

    # -- children ------------------------------------------------------------------------
    def spawn(self, name: str, argv: list[str], grpc_address: str | None = None) -> Child:
        log_path = os.path.join(self.log_dir, f"{name}.log")
        env = dict(os.environ)
        place = self.spec.placement.get(name)
        if place is not None:  # a worker's GPUs (CUDA_VISIBLE_DEVICES)
            env.update(place.env)
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                    else "")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env["SPLITSERVE_CLUSTER_TOKEN"] = self.cluster_token
        if is_gateway(name):
            env["SPLITSERVE_ADMIN_KEY"] = self.admin_key
        return self.supervisor.start(name, argv, env, log_path, grpc_address)

    def cli_argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "cluster.cli", *args]

    def start_redis(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise ClusterError("redis-server is not installed; run `make sysdeps` "
                               "(apt-get install redis-server)")
        port = free_port(self.spec.host)
        self.spawn("redis", [exe, "--port", str(port), "--bind", self.spec.host, "--save",
                              "", "--appendonly", "no", "--protected-mode", "no"])
        self.redis_url = f"redis://{self.spec.host}:{port}"
        self._wait_redis(port)

    def _wait_redis(self, port: int) -> None:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(
                    (self.spec.host, port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            self.check_alive()
            time.sleep(0.05)
        raise ClusterError(f"redis-server did not answer on port {port} within 10 s")

    def start_worker(self, role: str, index: int) -> Child:
        port = free_port(self.spec.host)
        wid = f"{role}-{index}"
        argv = self.cli_argv("worker", "--role", role, "--port", str(port), "--worker-id", wid,
                         "--metrics-port", str(free_port(self.spec.host)),
                         "--redis", self.redis_url, "--model", self.spec.model_dir,
                         "--transport", self.spec.transport, *self.spec.worker_args)
        place = self.spec.placement.get(wid)
        if place is not None:
            argv += place.args
        child = self.spawn(wid, argv, f"{self.spec.host}:{port}")
        child.extra["metrics_port"] = argv[argv.index("--metrics-port") + 1]
        return child

    def start_gateway(self, index: int = 0) -> Child:
        http, grpc_port = self.http_ports[index], self.grpc_ports[index]
        argv = self.cli_argv("gateway", "--http-port", str(http), "--grpc-port",
                         str(grpc_port), "--redis", self.redis_url, "--model",
                         self.spec.model_dir, *self.spec.gateway_args)
        child = self.spawn(gateway_name(index), argv, f"{self.spec.host}:{grpc_port}")
        child.extra["http_port"] = str(http)
        return child

    def start(self) -> None:
        """Starts everything and waits until all are ready; stops all on failure. A
        start that lost a port (PortTakenError, for a port the launcher chose) stops
        and starts again on fresh ports, at most `_START_TRIES` times in all."""
        for attempt in range(1, _START_TRIES + 1):
            try:
                self._start_once()
                return
            except PortTakenError as e:
                chosen = not is_gateway(e.name) or not (self.spec.http_port or
                                                        self.spec.grpc_port)
                if not chosen or attempt == _START_TRIES:
                    raise
                log.warning("%s could not bind its port (taken since it was chosen); "
                            "starting the cluster again on fresh ports", e.name)
                self.children.clear()
                self._choose_gateway_ports()

    def _choose_gateway_ports(self) -> None:
        spec = self.spec
        self.http_ports = consecutive_ports(spec.host, spec.http_port, spec.num_gateways)
        self.grpc_ports = consecutive_ports(spec.host, spec.grpc_port, spec.num_gateways)
        self.http_port, self.grpc_port = self.http_ports[0], self.grpc_ports[0]

    def _start_once(self) -> None:
        try:
            write_private(self.admin_key_path, self.admin_key)
            self.start_redis()
            for role, n in (("decode", self.spec.num_decode),
                            ("colocated", self.spec.num_colocated),
                            ("prefill", self.spec.num_prefill)):
                for i in range(n):
                    self.start_worker(role, i)
            for i in range(self.spec.num_gateways):
                self.start_gateway(i)
            self.wait_ready()
            self.write_status()
        except BaseException:
            self.stop()
            raise

    # -- readiness -------------------------------------------------------------------------
    def check_alive(self) -> None:
        for c in self.children:
            if c.proc.poll() is not None:
                tail = c.log_tail()
                if _PORT_TAKEN in tail and not c.restarts:
                    raise PortTakenError(c.name, f"{c.name} could not bind its port; its "
                                         f"log ({c.log_path}) ends:\n{tail}")
                raise ClusterError(f"{c.name} exited with code {c.proc.returncode}; its log "
                                   f"({c.log_path}) ends:\n{c.log_tail()}")

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Every child healthy, then each gateway routing to every worker (they discover
        them through Redis a moment after they register)."""
        from cluster.health import is_ready

        deadline = time.monotonic() + (timeout_s or self.spec.ready_timeout_s)
        pending = [c for c in self.children if c.grpc_address]
        while pending:
            self.check_alive()
            pending = [c for c in pending if not is_ready(c.grpc_address or "")]
            if not pending:
                break
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise ClusterError(f"not ready in time: {names} (logs in {self.log_dir})")
            time.sleep(0.25)
        workers = {c.grpc_address for c in self.children
                   if c.grpc_address and not is_gateway(c.name)}
        for c in self.children:
            if is_gateway(c.name):
                self._wait_routable(c.name, int(c.extra["http_port"]), workers, deadline)

    def _wait_routable(self, name: str, http_port: int, addresses: set[str],
                       deadline: float) -> None:
        while True:
            self.check_alive()
            known = routable_addresses(self.spec.host, http_port, self.admin_key)
            if known is not None and addresses <= known:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"{name} did not see every worker in time "
                                   f"(logs in {self.log_dir})")
            time.sleep(0.1)

    # -- supervision -----------------------------------------------------------------------
    def supervise(self) -> None:
        """One supervision round (restart exited children after their backoff) and an
        updated status.json. Raises CrashLoopError when a child keeps exiting; the caller
        then stops the cluster."""
        try:
            changed = self.supervisor.poll()
        except CrashLoopError:
            self.write_status()
            raise
        if changed:
            self.write_status()

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts per child since start."""
        return self.supervisor.restarts()

    def write_status(self) -> None:
        """`<log_dir>/status.json`: pid, running, restarts, last exit and log per child,
        replaced atomically so a reader never sees half a file."""
        tmp = self.status_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"redis_url": self.redis_url, "http_port": self.http_port,
                       "grpc_port": self.grpc_port, "http_ports": self.http_ports,
                       "grpc_ports": self.grpc_ports, "children": self.supervisor.status()}, f,
                      indent=1)
        os.replace(tmp, self.status_path)

    # -- stopping --------------------------------------------------------------------------
    def stop_child(self, child: Child, sig: int = signal.SIGTERM,
                   timeout_s: float | None = None) -> int | None:
        """Stops `child` for good (supervision does not restart it); past `timeout_s`
        (default: the spec's stop timeout) it is killed."""
        return self.supervisor.stop(child, sig, timeout_s or self.spec.stop_timeout_s)

    def stop(self) -> None:
        """Gateways first (no new work), then prefill workers (their last pushes still
        land in live decode workers), then the other workers (they drain), then redis;
        the children of one step stop together."""
        def step(c: Child) -> int:
            if is_gateway(c.name):
                return 0
            return 1 if c.name.startswith("prefill-") else 3 if c.name == "redis" else 2
        for i in range(4):
            group = [c for c in self.children if step(c) == i]
            if group:
                self.supervisor.stop_all(group, timeout_s=self.spec.stop_timeout_s)
        with contextlib.suppress(OSError):
            self.write_status()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
