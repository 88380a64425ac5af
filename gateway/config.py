"""The gateway's configuration (one frozen dataclass, built by gateway/cli.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.identity import TenantKey
from gateway.routing.profile import RoutingProfile
from protos.auth import RpcSecurity

MIN_IN_FLIGHT = 256  # the automatic in-flight limit of a small cluster
# Per serving worker: a fixed 256 turned away 20-34 % of requests on 64 simulated GPUs at
# 1 req/s each (`splitserve sim experiment routing`, docs/simulator.md); 32 per GPU turned
# none away.
IN_FLIGHT_PER_WORKER = 32


def in_flight_limit(configured: int, serving_workers: int) -> int:
    """The gateway's limit on requests in flight: `configured` when set (> 0), else
    IN_FLIGHT_PER_WORKER per serving (decode or colocated) worker, at least MIN_IN_FLIGHT."""
    return configured or max(MIN_IN_FLIGHT, IN_FLIGHT_PER_WORKER * serving_workers)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway needs; `model_dir` is read for the tokenizer and limits."""

    model_dir: str
    served_model_name: str
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int | None = None  # None: no gRPC front
    redis_url: str | None = None
    static_workers: tuple[str, ...] = ()  # host:port of decode/colocated/prefill workers
    api_keys: tuple[str, ...] = ()  # empty: no auth
    # More concurrent requests get 429 / RESOURCE_EXHAUSTED. 0: grows with the cluster
    # (in_flight_limit: IN_FLIGHT_PER_WORKER per serving worker, at least MIN_IN_FLIGHT).
    max_in_flight: int = 0
    client_max_size: int = 4 * 1024 * 1024  # bytes of an HTTP body
    request_timeout_s: float = 600.0  # whole-request deadline when the client sets none
    worker_rpc_timeout_s: float = 2.0  # Info and other unary calls to workers
    discovery_interval_s: float = 1.0
    redis_timeout_s: float = 0.5
    load_stale_s: float = 3.0  # no load report for this long: out of routing
    redis_missing_grace_s: float = 10.0  # a live worker missing from Redis stays this long
    retry_backoff_max_s: float = 2.0
    max_route_attempts: int = 2  # tries when a worker fails before its first token
    max_failovers: int = 2  # resumes on another worker after a failure mid-stream
    failover_wait_s: float = 10.0  # how long a resume waits for a routable worker
    routing: RoutingProfile = field(default_factory=RoutingProfile)
    admin_key: str | None = None  # Bearer key of /admin/v1/*; None: the admin API is off
    index_timeout_ms: int = 50  # deadline of one block index lookup
    index_breaker_failures: int = 3  # consecutive index failures that stop lookups...
    index_breaker_cooldown_s: float = 2.0  # ...for this long, then one probe
    locality_alpha: float = 0.2  # EWMA weight of one request in the index accuracy
    locality_min_trust: float = 0.1  # floor of a worker's locality trust
    tenant_keys: tuple[TenantKey, ...] = ()  # API key -> tenant and labels (also accepted)
    default_tenant: str = "default"  # requests no key or trusted claim identifies
    trust_client_identity: bool = False  # honour X-Tenant/X-Labels, metadata.tenant
    max_waiting_per_worker: int = 16  # a worker with this many waiting takes no more...
    kv_headroom: float = 0.0  # ...nor one with less free KV than this (0: not checked)
    admission_queue_size: int = 256  # requests waiting at the gateway; more get 429
    admission_order: str = "vtc"  # "vtc": fair across tenants; "fcfs": arrival order
    strategies_poll_s: float = 1.0  # how often the stored scheduling strategies are read
    # Format of tool calls in the model's output (gateway/tool_parsers.py): a parser
    # name, "auto" (from the chat template) or "none" (tool_choice "auto" refused).
    tool_call_parser: str = "auto"
    generation_config: str = "auto"  # vLLM's --generation-config: auto, vllm or a directory
    # Signs every call to a worker with the cluster token; TLS for the gRPC front and
    # towards workers (protos/auth.py).
    security: RpcSecurity = field(default_factory=RpcSecurity)

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must be non-empty")
        if not self.redis_url and not self.static_workers:
            raise ValueError("give a Redis URL or a static worker list (or both)")
        for addr in self.static_workers:
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"worker address must be host:port, got {addr!r}")
        if self.max_in_flight < 0 or self.client_max_size <= 0:
            raise ValueError("max_in_flight must be >= 0 (0: grows with the cluster) and "
                             "client_max_size positive")
        if min(self.request_timeout_s, self.worker_rpc_timeout_s, self.discovery_interval_s,
               self.redis_timeout_s, self.load_stale_s, self.retry_backoff_max_s,
               self.redis_missing_grace_s) <= 0:
            raise ValueError("timeouts and intervals must be positive")
        if self.max_route_attempts < 1:
            raise ValueError("max_route_attempts must be >= 1")
        if self.max_failovers < 0 or self.failover_wait_s < 0:
            raise ValueError("max_failovers and failover_wait_s must be >= 0")
        if self.admin_key is not None and len(self.admin_key) < 8:
            raise ValueError("the admin key must be at least 8 characters")
        if self.index_timeout_ms <= 0 or self.index_breaker_failures < 1 \
                or self.index_breaker_cooldown_s <= 0:
            raise ValueError("index timeout, breaker failures and cooldown must be positive")
        if not 0 < self.locality_alpha <= 1 or not 0 <= self.locality_min_trust <= 1:
            raise ValueError("need 0 < locality_alpha <= 1 and 0 <= locality_min_trust <= 1")
        if self.max_waiting_per_worker < 1 or self.admission_queue_size < 0:
            raise ValueError("need max_waiting_per_worker >= 1 and admission_queue_size >= 0")
        if not 0 <= self.kv_headroom < 1 or self.strategies_poll_s <= 0:
            raise ValueError("need 0 <= kv_headroom < 1 and strategies_poll_s > 0")
        if self.admission_order not in ("vtc", "fcfs"):
            raise ValueError("admission_order must be 'vtc' or 'fcfs'")
