"""What a cluster must look like once a run is over, read from the outside: every
child alive and never restarted, every worker's KV blocks free when idle (no leak),
each process's resident memory and open file descriptors (from /proc).

Shared by `splitserve bench soak` and `bench experiment faults`. Worker load reports
are signed with the cluster's token (the launcher's, `LocalCluster.cluster_token`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import grpc

from cluster.launcher import LocalCluster
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from protos.auth import signed_metadata


@dataclass(frozen=True, slots=True)
class Blocks:
    """One worker's KV pool: a request that ended must leave every block free (prefix-
    cached blocks count as free: they are evictable)."""

    free: int
    total: int
    active: int  # requests the worker still holds

    @property
    def leaked(self) -> int:
        return self.total - self.free


def worker_blocks(address: str, token: str, timeout_s: float = 3.0) -> Blocks:
    """The worker's first load report (its Load stream, cancelled after one)."""
    md = signed_metadata(token, "/splitserve.v1.Worker/Load")
    with grpc.insecure_channel(address) as ch:
        call = pb_grpc.WorkerStub(ch).Load(pb.LoadRequest(min_interval_ms=50),
                                           timeout=timeout_s, metadata=md)
        try:
            r = next(iter(call))
        finally:
            call.cancel()
    return Blocks(r.num_free_blocks, r.num_blocks, r.num_active)


def workers(cluster: LocalCluster) -> dict[str, str]:
    """Running worker name -> gRPC address (the gateway and redis are not workers; an
    exited child has no blocks to count: `sample_all` reports it as gone)."""
    return {c.name: c.grpc_address for c in cluster.children
            if c.grpc_address and not c.name.startswith("gateway") and c.proc.poll() is None}


def idle_blocks(cluster: LocalCluster, timeout_s: float = 15.0) -> dict[str, Blocks]:
    """Each worker's blocks once nothing is running (or as they are at the timeout):
    aborted requests free their blocks a moment after the client left."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = {}
        for name, addr in workers(cluster).items():
            try:
                out[name] = worker_blocks(addr, cluster.cluster_token)
            except grpc.RpcError:
                out[name] = Blocks(0, -1, -1)  # unreachable: reported as such
        if all(b.leaked == 0 and b.active == 0 for b in out.values()) \
                or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


@dataclass(frozen=True, slots=True)
class ProcSample:
    rss_bytes: int
    fds: int


def proc_sample(pid: int) -> ProcSample | None:
    """Resident set size and open descriptors of `pid` (None: gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss_kb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None
    return ProcSample(rss_kb * 1024, fds)


def sample_all(cluster: LocalCluster) -> dict[str, ProcSample | None]:
    return {c.name: proc_sample(c.proc.pid) for c in cluster.children}
