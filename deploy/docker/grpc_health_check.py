#!/usr/bin/env python3
"""`splitserve-health HOST:PORT [SERVICE]`: exit 0 when the grpc.health.v1 service answers
SERVING, 1 otherwise (2 on bad usage). For container HEALTHCHECKs (docker compose) and exec
probes on Kubernetes versions without native gRPC probes. SERVICE: readiness (default) or
liveness, the names splitserve's gateway and workers serve. The call has a 3 s deadline."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2) or ":" not in argv[0]:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    service = argv[1] if len(argv) == 2 else "readiness"
    try:
        with grpc.insecure_channel(argv[0]) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=3.0)
    except grpc.RpcError as e:
        print(f"{argv[0]} {service}: {e.code().name}", file=sys.stderr)
        return 1
    ok = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{argv[0]} {service}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
