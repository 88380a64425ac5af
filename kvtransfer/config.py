"""Transport configuration: one frozen dataclass, built at the entry point (CLI/YAML).

Nothing in kvtransfer reads environment variables; UCX options are passed here and
applied by the ucx transport before ucxx initialises.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.faults import FaultSpec
from kvtransfer.grants import COPY_BUDGET_S

TRANSPORTS = ("tcp", "shm", "ucx", "cuda_ipc", "auto")

# Host KV caches: TCP (RMA emulated over it between hosts without RDMA) and `self` for
# loopback. A receiver on the sender's node is written with process_vm_writev by the
# sender itself (`kvtransfer/host_copy.py`): under peer error handling UCX has no `cma`
# for RMA. (UCX_RNDV_THRESH only matters to tag messages, which KV does not use.)
HOST_UCX_OPTIONS: tuple[tuple[str, str], ...] = (
    ("TLS", "tcp,self"),
    ("RNDV_THRESH", "8192"),
)
# CUDA KV caches: UCX picks its transports (cuda_ipc over NVLink/PCIe on one host,
# RDMA between hosts); a TLS list would have to name every one of them.
CUDA_UCX_OPTIONS: tuple[tuple[str, str], ...] = (("RNDV_THRESH", "8192"),)


INLINE_COPY_BYTES = 1 << 20  # `TransferConfig.inline_copy_bytes`'s default


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Settings shared by the sender and receiver of one transport.

    token: the cluster's shared secret; a peer must prove it at handshake.
    lease_s: how long a receiver keeps destination blocks waiting (vLLM: 30 s).
    io_timeout_s: deadline of every single network call (connect, send, reply).
    liveness_timeout_s: a peer silent for this long (no frame, not even a
        heartbeat every heartbeat_s) is declared unavailable; it exceeds heartbeat_s,
        and io_timeout_s (an in-place grant's ttl past the newest answered PING) is
        at least twice heartbeat_s.
    copy_budget_s: how long past a grant's start bound a copy the sender started may
        still write (`grants.COPY_BUDGET_S`, the default); the receiver reuses a revoked
        grant's cells only past the bound, this budget and a margin. Sender and receiver
        must agree on it.
    """

    transport: str = "tcp"
    token: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    lease_s: float = 30.0
    io_timeout_s: float = 10.0
    heartbeat_s: float = 1.0
    liveness_timeout_s: float = 5.0
    copy_budget_s: float = COPY_BUDGET_S
    checksum: bool = False
    socket_buffer_bytes: int = 4 << 20
    shm_name: str | None = None
    # None: HOST_UCX_OPTIONS or CUDA_UCX_OPTIONS, by where the KV cache lives.
    ucx_options: tuple[tuple[str, str], ...] | None = None
    # A host-memory ucx receiver on the sender's node is written by the sender itself
    # (process_vm_writev, `kvtransfer/host_copy.py`); off: UCX moves its bytes too, as
    # between hosts (RMA emulated over TCP without RDMA), e.g. to test that path on one box.
    ucx_host_copy: bool = True
    # Sender UCX workers (lanes), each with its own progress thread, endpoint and
    # issuing thread: a chunk's puts are dealt across them and a region of 1 MiB or
    # more is split, so that several copies run at once (into a receiver on this node,
    # one process_vm_writev stream tops out at ~4.3 GB/s here, two reach ~7).
    ucx_lanes: int = 2
    # cuda_ipc on host caches: a chunk of at most this many bytes is copied on the
    # sender's event loop, a larger one on the host mover's copy thread (`HostMover`)
    inline_copy_bytes: int = INLINE_COPY_BYTES
    # Testing: seeded faults the tcp sender injects on its WRITE frames (None: off).
    faults: FaultSpec | None = None

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not self.token:
            raise ValueError("a non-empty shared cluster token is required")
        for name in ("lease_s", "io_timeout_s", "heartbeat_s", "liveness_timeout_s",
                     "copy_budget_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.liveness_timeout_s <= self.heartbeat_s:
            raise ValueError("liveness_timeout_s must exceed heartbeat_s")
        if self.io_timeout_s < 2 * self.heartbeat_s:
            # an in-place grant holds io_timeout_s past the newest PING answered: it
            # must outlast the time between PINGs plus a PING's round trip, which on a
            # loaded host can take most of another interval
            raise ValueError("io_timeout_s must be at least twice heartbeat_s")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in [0, 65535]")
        if self.inline_copy_bytes < 0:
            raise ValueError("inline_copy_bytes must be >= 0")
        if not 1 <= self.ucx_lanes <= 8:
            raise ValueError("ucx_lanes must be in [1, 8]")
        if self.socket_buffer_bytes < 65536:
            raise ValueError("socket_buffer_bytes must be at least 64 KiB")
        for item in self.ucx_options or ():
            if len(item) != 2 or item[0].startswith("UCX_"):
                raise ValueError("ucx_options are (NAME, value) pairs without the UCX_ prefix")

    def ucx_options_for(self, cuda: bool) -> tuple[tuple[str, str], ...]:
        """The UCX options for a KV cache in host (cuda=False) or device memory."""
        if self.ucx_options is not None:
            return self.ucx_options
        return CUDA_UCX_OPTIONS if cuda else HOST_UCX_OPTIONS
