"""The worker's configuration (one frozen dataclass, built by worker/cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtransfer.faults import FaultSpec
from protos.auth import RpcSecurity

if TYPE_CHECKING:
    from worker.kv_events_zmq import KVEventsConfig

ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """How a worker serves. `role` "colocated" always prefills locally; "decode" may
    take a prefill peer from the gateway (remote prefill; see WorkerService._run);
    "prefill" serves `Prefill` (worker/handoff.py) besides Info/Load; it refuses
    Generate."""

    role: str
    worker_id: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    advertise_host: str = ""  # what others dial; "" -> host
    metrics_port: int | None = None
    redis_url: str | None = None
    registration_ttl_s: float = 5.0
    heartbeat_s: float = 1.0
    redis_timeout_s: float = 1.0
    load_interval_ms: int = 100
    load_keepalive_s: float = 1.0  # a report at least this often, changed or not
    drain_timeout_s: float = 30.0
    kv_failure_policy: str = "recompute"  # decode: after a failed remote prefill
    prefill_timeout_s: float = 30.0  # decode: deadline of one Prefill call
    # The cluster credential on its RPCs, served and made (protos/auth.py); mTLS.
    security: RpcSecurity = field(default_factory=RpcSecurity)
    # vLLM's --kv-events-config: block events on vLLM's ZMQ wire (worker/kv_events_zmq.py)
    kv_events: KVEventsConfig | None = None
    faults: FaultSpec | None = None  # testing: seeded faults on its RPCs (worker/faults.py)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not self.worker_id:
            raise ValueError("worker_id must be non-empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.heartbeat_s <= 0 or self.registration_ttl_s <= self.heartbeat_s:
            raise ValueError("need 0 < heartbeat_s < registration_ttl_s")
        if self.load_interval_ms <= 0 or self.load_keepalive_s <= 0:
            raise ValueError("load_interval_ms and load_keepalive_s must be positive")
        if self.kv_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_failure_policy must be 'recompute' or 'fail'")
        if self.prefill_timeout_s <= 0:
            raise ValueError("prefill_timeout_s must be positive")
        if self.drain_timeout_s < 0 or self.redis_timeout_s <= 0:
            raise ValueError("drain_timeout_s must be >= 0 and redis_timeout_s > 0")
