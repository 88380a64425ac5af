"""grpc.health.v1 readiness probe with a deadline (used by the launcher and tests)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_ready(address: str, service: str = "readiness", timeout_s: float = 1.0) -> bool:
    """True when `address` answers SERVING for `service` within the timeout."""
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
            return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False
