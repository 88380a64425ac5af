"""`splitserve worker`: run a prefill, decode or colocated worker (env vars are read only
here: SPLITSERVE_REDIS_URL, SPLITSERVE_CLUSTER_TOKEN, SPLITSERVE_LOG_LEVEL)."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import logging
import os
import socket
import sys
import uuid
from typing import TYPE_CHECKING, NoReturn

from engine.cli import add_engine_arguments
from protos.auth import add_tls_arguments

if TYPE_CHECKING:
    from kvtransfer.config import TransferConfig
    from kvtransfer.faults import FaultSpec
    from protos.auth import RpcSecurity
    from worker.kv_events_zmq import KVEventsConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p)
    p.add_argument("--role", choices=["prefill", "decode", "colocated"], default="colocated",
                   help="prefill: serves Prefill (writes KV into decode workers); decode: "
                        "may take a prefill peer per request; colocated: always local")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    p.add_argument("--advertise-host", default="", help="host others dial (default --host)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port")
    p.add_argument("--worker-id", default="", help="default: <hostname>-<role>-<random>")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the model directory's name)")
    p.add_argument("--redis", default=os.environ.get("SPLITSERVE_REDIS_URL"),
                   help="redis://host:port to register in (default $SPLITSERVE_REDIS_URL)")
    p.add_argument("--registration-ttl", type=float, default=5.0)
    p.add_argument("--heartbeat", type=float, default=1.0)
    p.add_argument("--load-interval-ms", type=int, default=100)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--transport", choices=["tcp", "shm", "ucx", "cuda_ipc", "auto"],
                   default="tcp",
                   help="KV transfer between prefill and decode workers. GPU caches: "
                        "cuda_ipc (one node; another GPU must be visible and a P2P peer), "
                        "ucx (RMA, between nodes), auto (per peer: cuda_ipc where it can "
                        "map the decode's cache, ucx elsewhere). Host caches: tcp, shm "
                        "(one node), ucx; auto means tcp there")
    p.add_argument("--transfer-host", default=None,
                   help="address the decode's KV receiver binds (default --host)")
    p.add_argument("--transfer-port", type=int, default=0, help="KV receiver port (0: any)")
    p.add_argument("--cluster-token-file", default=None,
                   help="file holding the cluster's KV-transfer token "
                        "(default $SPLITSERVE_CLUSTER_TOKEN)")
    p.add_argument("--rpc-auth-window", type=float, default=30.0,
                   help="seconds a signed worker RPC stays valid (clock skew + replay "
                        "window; protos/auth.py)")
    add_tls_arguments(p, "this worker")
    p.add_argument("--kv-events-config", default=None,
                   help="vLLM's KV events config (JSON): e.g. '{\"enable_kv_cache_events\": "
                        "true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                        "\"replay_endpoint\": \"tcp://*:5558\"}' publishes block events "
                        "as vLLM does, beside the Redis index")
    p.add_argument("--faults", default=os.environ.get("SPLITSERVE_FAULTS", ""),
                   help="TESTING ONLY: seeded faults on the KV wire and this worker's RPCs, "
                        "e.g. 'seed=1,wire.corrupt=0.2,rpc.delay=0.5' (kvtransfer/faults.py; "
                        "default $SPLITSERVE_FAULTS; empty: off)")
    p.add_argument("--kv-failure-policy", choices=["recompute", "fail"], default="recompute",
                   help="decode: what a failed remote prefill does")
    p.add_argument("--prefill-timeout", type=float, default=30.0,
                   help="decode: deadline in seconds of one Prefill call to a prefill peer")
    p.add_argument("--kv-lease", type=float, default=30.0,
                   help="seconds a transfer may take before its blocks are fenced and reused")
    p.add_argument("--kv-checksum", action="store_true",
                   help="verify a checksum of every transferred region")
    p.add_argument("--ucx-lanes", type=int, default=2,
                   help="ucx: UCX workers a decode's receiver splits large regions across")
    p.add_argument("--ucx-option", action="append", default=[], metavar="NAME=VALUE",
                   help="ucx: a UCX setting without the UCX_ prefix, e.g. TLS=rc,cuda_ipc "
                        "(repeatable; replaces the defaults for the KV cache's memory)")
    p.add_argument("--log-level", default=os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO"))


def served_model_name(model_dir: str, explicit: str | None) -> str:
    # Same default as the gateway's (gateway/cli.py): the directory's base name.
    return explicit or os.path.basename(os.path.normpath(model_dir))


def cluster_token(args: argparse.Namespace) -> str:
    if args.cluster_token_file:
        with open(args.cluster_token_file) as f:
            return f.read().strip()
    return os.environ.get("SPLITSERVE_CLUSTER_TOKEN", "")


def rpc_security(args: argparse.Namespace) -> RpcSecurity:
    """The credential this worker checks on its RPCs (and signs its calls to peers
    with): the cluster token, and TLS when --tls-* are given. Prefill and decode
    workers cannot start without the token (transfer_config); a colocated worker
    without one serves its RPCs unauthenticated, and says so."""
    from protos.auth import RpcSecurity, tls_from_args

    token = cluster_token(args)
    if not token and args.role == "colocated":  # the other roles stop in transfer_config
        logging.getLogger(__name__).warning(
            "no cluster token (SPLITSERVE_CLUSTER_TOKEN / --cluster-token-file): this "
            "worker's RPCs are UNAUTHENTICATED; anyone who reaches its port can use it")
    try:
        return RpcSecurity(token, tls_from_args(args.tls_cert, args.tls_key, args.tls_ca),
                           args.rpc_auth_window)
    except ValueError as e:
        raise SystemExit(f"invalid RPC security settings: {e}") from None


def kv_events_config(args: argparse.Namespace) -> KVEventsConfig | None:
    from worker.kv_events_zmq import KVEventsConfig

    if not args.kv_events_config:
        return None
    try:
        return KVEventsConfig.from_json(args.kv_events_config)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"invalid --kv-events-config: {e}") from None


def fault_spec(args: argparse.Namespace) -> FaultSpec | None:
    from kvtransfer.faults import FaultSpec

    try:
        return FaultSpec.parse(args.faults)
    except ValueError as e:
        raise SystemExit(f"invalid --faults: {e}") from None


def resolve_transport(transport: str, device: str) -> str:
    """`auto` on a GPU is the `auto` transport (cuda_ipc to peers on this node, ucx to
    the others, chosen per peer at connect); on a host cache it is `tcp`, which works
    between any two hosts (shm wants the decode's cache in a shared segment: ask for
    it by name)."""
    if transport != "auto":
        return transport
    return "auto" if device.startswith("cuda") else "tcp"


def transfer_config(args: argparse.Namespace) -> TransferConfig | None:
    """The KV-transfer settings of a prefill or decode worker; None when colocated."""
    from kvtransfer.config import TransferConfig

    if args.role == "colocated":
        return None
    token = cluster_token(args)
    if not token:
        raise SystemExit(f"a {args.role} worker needs the cluster's KV-transfer token: set "
                         "SPLITSERVE_CLUSTER_TOKEN or pass --cluster-token-file")
    options = []
    for item in args.ucx_option:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--ucx-option takes NAME=VALUE, got {item!r}")
        options.append((name.removeprefix("UCX_"), value))
    try:
        return TransferConfig(transport=resolve_transport(args.transport, args.device),
                              token=token, faults=fault_spec(args),
                              host=args.transfer_host or args.host, port=args.transfer_port,
                              lease_s=args.kv_lease, checksum=args.kv_checksum,
                              ucx_lanes=args.ucx_lanes,
                              ucx_options=tuple(options) if options else None)
    except ValueError as e:
        raise SystemExit(f"invalid KV-transfer settings: {e}") from None


def check_tensor_parallel(args: argparse.Namespace) -> None:
    """Refuses, in one line, what tensor parallelism does not cover yet: LMCache (it
    reads the engine's cache itself; each rank holds only its KV heads). The KV
    hand-off, peer fetch and the host and disk tiers move full-head blocks gathered on
    rank 0."""
    tp = getattr(args, "tensor_parallel_size", 1)
    if tp > 1 and getattr(args, "lmcache_config", None):
        raise SystemExit(f"--tensor-parallel-size {tp} runs without --lmcache-config")


def run(args: argparse.Namespace) -> NoReturn:
    from engine.cli import engine_config_from_args
    from worker.config import WorkerConfig
    from worker.server import serve, with_model_id

    check_tensor_parallel(args)
    worker_id = args.worker_id or f"{socket.gethostname()}-{args.role}-{uuid.uuid4().hex[:6]}"
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"ts=%(asctime)s level=%(levelname)s service=worker worker_id={worker_id} "
               "logger=%(name)s %(message)s")
    ecfg = engine_config_from_args(args)
    ecfg = with_model_id(ecfg, served_model_name(ecfg.model_dir, args.served_model_name))
    config = WorkerConfig(
        role=args.role, worker_id=worker_id, host=args.host, port=args.port,
        advertise_host=args.advertise_host, metrics_port=args.metrics_port,
        redis_url=args.redis, registration_ttl_s=args.registration_ttl,
        heartbeat_s=args.heartbeat, load_interval_ms=args.load_interval_ms,
        drain_timeout_s=args.drain_timeout, kv_failure_policy=args.kv_failure_policy,
        prefill_timeout_s=args.prefill_timeout, security=rpc_security(args),
        kv_events=kv_events_config(args), faults=fault_spec(args))
    from kvtransfer.tiers.config import tier_config_from_args

    code = asyncio.run(serve(config, ecfg, transfer_config(args),
                             tier_config_from_args(args)))
    exit_now(int(code or 0))


def exit_now(code: int) -> NoReturn:
    """Ends a worker whose server has shut down: the exit handlers run (the TP group's
    close among them), then the process ends without the interpreter's teardown, which
    frees the model's and torch's objects one by one (about a second, in which a
    supervisor or a rolling restart waits for nothing the worker still holds)."""
    atexit._run_exitfuncs()
    logging.shutdown()
    with contextlib.suppress(OSError):  # a supervisor's pipe may be gone
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
