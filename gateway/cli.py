"""`splitserve gateway`: the OpenAI HTTP + gRPC front (env vars are read only here)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import TYPE_CHECKING

from protos.auth import add_tls_arguments

if TYPE_CHECKING:
    from protos.auth import RpcSecurity


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="model directory (tokenizer, limits; default: the embedded model)")
    p.add_argument("--served-model-name", default=None,
                   help="name clients use (default: the model directory's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=None)
    p.add_argument("--redis", default=os.environ.get("SPLITSERVE_REDIS_URL"),
                   help="redis://host:port to discover workers in")
    p.add_argument("--workers", default="", help="static worker list: host:port,host:port")
    p.add_argument("--api-key", action="append", default=[],
                   help="accepted Bearer key on /v1/* (repeatable; default $SPLITSERVE_API_KEY)")
    p.add_argument("--routing", default=None, help="routing profile YAML")
    p.add_argument("--admin-key", default=os.environ.get("SPLITSERVE_ADMIN_KEY"),
                   help="Bearer key of the admin API (/admin/v1/routing, "
                        "/api/v1/scheduling/strategies); default "
                        "$SPLITSERVE_ADMIN_KEY; unset: the admin API is off")
    p.add_argument("--tenants", default=None,
                   help="YAML/JSON mapping API keys to tenants and labels: {keys: {<key>: "
                        "{tenant: gold, labels: {tier: paid}}}} (those keys are accepted too)")
    p.add_argument("--default-tenant", default="default",
                   help="tenant of requests that no key or trusted claim identifies")
    p.add_argument("--trust-client-identity", action="store_true",
                   help="honour X-Tenant / X-Labels headers, metadata.tenant and gRPC "
                        "GenerateRequest.tenant (behind a proxy that sets them)")
    p.add_argument("--max-waiting-per-worker", type=int, default=16,
                   help="a worker with this many requests waiting gets no more; requests "
                        "wait in the gateway's admission queue instead")
    p.add_argument("--kv-headroom", type=float, default=0.0,
                   help="a worker with less free KV cache than this fraction gets no new "
                        "requests (0: not checked)")
    p.add_argument("--admission-queue", type=int, default=256,
                   help="requests that may wait at the gateway for a worker; more get 429")
    p.add_argument("--admission-order", choices=["vtc", "fcfs"], default="vtc",
                   help="order of the admission queue: vtc (fair shares across tenants, "
                        "priority strategies first) or fcfs (arrival; the baseline)")
    p.add_argument("--strategies-poll", type=float, default=1.0,
                   help="seconds between reads of the stored scheduling strategies")
    p.add_argument("--load-stale", type=float, default=3.0,
                   help="seconds without a load report after which a worker is taken as "
                        "frozen: out of routing, its calls retried or resumed elsewhere")
    p.add_argument("--index-timeout-ms", type=int, default=50,
                   help="deadline of one Redis block index lookup")
    p.add_argument("--max-in-flight", type=int, default=0,
                   help="requests in flight at this gateway; more get 429 (default 0: 32 "
                        "per decode/colocated worker, at least 256)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--tool-call-parser", default="auto",
                   choices=["auto", "none", "hermes", "llama3_json"],
                   help="format of tool calls in the model's output, for tool_choice auto "
                        "(vLLM's --tool-call-parser); auto: from the chat template")
    p.add_argument("--generation-config", default="auto",
                   help="request defaults from generation_config.json, as vLLM's flag: auto "
                        "(the model directory's), vllm (none; EOS ids still apply) or a "
                        "directory holding one")
    p.add_argument("--max-failovers", type=int, default=2,
                   help="times a request whose decode worker fails mid-stream is resumed on "
                        "another (0: fail it)")
    p.add_argument("--failover-wait", type=float, default=10.0,
                   help="seconds a resume waits for a routable worker (within the deadline)")
    p.add_argument("--cluster-token-file", default=None,
                   help="file holding the cluster token that signs calls to workers "
                        "(default $SPLITSERVE_CLUSTER_TOKEN; protos/auth.py)")
    add_tls_arguments(p, "the gateway's gRPC front")
    p.add_argument("--log-level", default=os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO"))


def _security(args: argparse.Namespace) -> RpcSecurity:
    from protos.auth import RpcSecurity, tls_from_args

    token = os.environ.get("SPLITSERVE_CLUSTER_TOKEN", "")
    if args.cluster_token_file:
        with open(args.cluster_token_file) as f:
            token = f.read().strip()
    try:
        return RpcSecurity(token, tls_from_args(args.tls_cert, args.tls_key, args.tls_ca))
    except ValueError as e:
        raise SystemExit(f"invalid RPC security settings: {e}") from None


def run(args: argparse.Namespace) -> int:
    from engine.cli import resolve_model
    from gateway.config import GatewayConfig
    from gateway.identity import load_tenant_keys
    from gateway.routing.profile import RoutingProfile
    from gateway.server import serve

    logging.basicConfig(level=args.log_level.upper(),
                        format="ts=%(asctime)s level=%(levelname)s service=gateway "
                               "logger=%(name)s %(message)s")
    model_dir = resolve_model(args.model)
    keys = list(args.api_key) or ([os.environ["SPLITSERVE_API_KEY"]]
                                  if os.environ.get("SPLITSERVE_API_KEY") else [])
    config = GatewayConfig(
        model_dir=model_dir,
        # Same default as the worker's (worker/cli.py): the directory's base name.
        served_model_name=args.served_model_name or os.path.basename(
            os.path.normpath(model_dir)),
        host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
        redis_url=args.redis,
        static_workers=tuple(w.strip() for w in args.workers.split(",") if w.strip()),
        api_keys=tuple(keys), max_in_flight=args.max_in_flight,
        client_max_size=args.max_body_bytes, request_timeout_s=args.request_timeout,
        routing=RoutingProfile.from_yaml(args.routing) if args.routing else RoutingProfile(),
        admin_key=args.admin_key or None, index_timeout_ms=args.index_timeout_ms,
        security=_security(args), max_failovers=args.max_failovers,
        failover_wait_s=args.failover_wait, tool_call_parser=args.tool_call_parser,
        generation_config=args.generation_config,
        tenant_keys=load_tenant_keys(args.tenants) if args.tenants else (),
        default_tenant=args.default_tenant, trust_client_identity=args.trust_client_identity,
        max_waiting_per_worker=args.max_waiting_per_worker, kv_headroom=args.kv_headroom,
        admission_queue_size=args.admission_queue, admission_order=args.admission_order,
        strategies_poll_s=args.strategies_poll, load_stale_s=args.load_stale)
    return asyncio.run(serve(config, args.block_size, args.max_model_len))
