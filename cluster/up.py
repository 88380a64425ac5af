"""`splitserve up`: a local cluster (redis, workers, gateway) until Ctrl-C / SIGTERM.

With `--demo-request` it sends one request through the HTTP endpoint and prints it
(`make run`). The default is disaggregated: one prefill and one decode worker (tcp
transport); `--colocated N` alone starts colocated workers only.

Once up, the launcher supervises: a child that exits (Redis, a worker, the gateway) is
restarted after a backoff, and a crash loop stops everything with exit code 1 (the
`--restart-*` / `--max-restarts` flags; see cluster/supervisor.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import urllib.request
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: embedded model)")
    p.add_argument("--prefill", type=int, default=None, help="prefill workers")
    p.add_argument("--decode", type=int, default=None, help="decode workers")
    p.add_argument("--colocated", type=int, default=None, help="colocated workers")
    p.add_argument("--transport", choices=["ucx", "tcp", "shm", "cuda_ipc", "auto"],
                   default=None, help="KV transfer (splitserve worker --help); cuda_ipc wants "
                   "workers on CUDA")
    p.add_argument("--http-port", type=int, default=None, help="default 8000")
    p.add_argument("--grpc-port", type=int, default=None, help="default 50051")
    p.add_argument("--gateways", type=int, default=None, help="gateways on consecutive HTTP "
                   "and gRPC ports from --http-port / --grpc-port, sharing Redis (default 1)")
    p.add_argument("--config", default=None, help="YAML with the same keys as the flags, "
                   "plus worker_args / gateway_args lists")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker")
    p.add_argument("--device", default=None,
                   help="every worker's device (default auto: cuda when a GPU is visible)")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="every worker's dtype (default auto: the model's own on CUDA, "
                   "float32 on CPU)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8", "fp8_e4m3"],
                   help="every worker's KV cache dtype (default auto: the model's dtype)")
    p.add_argument("--calculate-kv-scales", action="store_true", default=None,
                   help="with --kv-cache-dtype fp8: every worker calculates its k/v scales "
                        "from its first request, or adopts those of the KV it receives first "
                        "(K_SCALE_CONSTANT / V_SCALE_CONSTANT from this environment)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="every worker's tensor parallel size (GPUs per worker; default 1)")
    p.add_argument("--prefill-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="prefill workers' tensor parallel size (default -tp)")
    p.add_argument("--decode-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="decode workers' tensor parallel size (default -tp)")
    p.add_argument("--gpus", default=None, metavar="0,1,...",
                   help="the GPUs workers get, disjoint sets in order (default: every "
                        "visible GPU)")
    p.add_argument("--share-gpus", action="store_true", default=None,
                   help="let workers share GPUs (round robin), splitting each GPU's "
                        "--gpu-memory-utilization between its workers")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of each GPU's memory the cluster may use (default 0.9)")
    p.add_argument("--demo-request", action="store_true",
                   help="send one request through the HTTP endpoint once ready")
    p.add_argument("--restart-backoff", type=float, default=None,
                   help="seconds before the first restart of an exited child (default 0.5; "
                   "doubles per restart)")
    p.add_argument("--restart-backoff-max", type=float, default=None,
                   help="longest wait before a restart (default 10)")
    p.add_argument("--restart-reset-after", type=float, default=None,
                   help="a child up this many seconds starts from the first backoff again "
                   "(default 30)")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="restarts of one child within --restart-window before the cluster "
                   "stops (default 5; 0: any exit stops it)")
    p.add_argument("--restart-window", type=float, default=None,
                   help="seconds (default 60)")


# settings key (flag or YAML) -> (RestartPolicy field, its type)
RESTART_KEYS: dict[str, tuple[str, type]] = {
    "restart_backoff": ("backoff_initial_s", float),
    "restart_backoff_max": ("backoff_max_s", float),
    "restart_reset_after": ("reset_after_s", float),
    "max_restarts": ("max_restarts", int),
    "restart_window": ("window_s", float)}


PLACEMENT_KEYS = ("tensor_parallel_size", "prefill_tensor_parallel_size",
                  "decode_tensor_parallel_size", "gpus", "share_gpus", "gpu_memory_utilization")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    conf: dict[str, Any] = {}
    if args.config:
        import yaml

        with open(args.config) as f:
            conf = yaml.safe_load(f) or {}
        if not isinstance(conf, dict):
            raise ValueError(f"{args.config}: expected a mapping")
    for key in ("model", "prefill", "decode", "colocated", "transport", "http_port",
                "grpc_port", "gateways", "num_blocks", "device", "dtype", "kv_cache_dtype",
                "calculate_kv_scales", *PLACEMENT_KEYS,
                *RESTART_KEYS):
        if getattr(args, key) is not None:
            conf[key] = getattr(args, key)
    return conf


def build_spec(args: argparse.Namespace) -> Any:
    from cluster.launcher import ClusterSpec, RestartPolicy
    from engine.cli import resolve_model

    s = _settings(args)
    disagg_default = not ({"decode", "colocated"} & set(s))
    prefill = int(s.get("prefill", 1 if disagg_default else 0))
    decode = int(s.get("decode", 1 if disagg_default else 0))
    colocated = int(s.get("colocated", 0 if (disagg_default or decode) else 1))
    worker_args = [str(a) for a in s.get("worker_args", [])]
    # after worker_args: the flags win
    for key in ("num_blocks", "device", "dtype", "kv_cache_dtype"):
        if s.get(key):
            worker_args += [f"--{key.replace('_', '-')}", str(s[key])]
    if s.get("calculate_kv_scales"):
        worker_args.append("--calculate-kv-scales")
    placement = place_workers(s, prefill, decode, colocated)
    return ClusterSpec(
        placement=placement,
        model_dir=resolve_model(s.get("model")), num_prefill=prefill, num_decode=decode,
        num_colocated=colocated, transport=str(s.get("transport", "tcp")),
        http_port=int(s.get("http_port", 8000)), grpc_port=int(s.get("grpc_port", 50051)),
        worker_args=tuple(worker_args),
        gateway_args=tuple(str(a) for a in s.get("gateway_args", [])),
        num_gateways=int(s.get("gateways", 1)),
        restart=RestartPolicy(**{field: kind(s[key])
                                 for key, (field, kind) in RESTART_KEYS.items() if key in s}))


def place_workers(s: dict[str, Any], prefill: int, decode: int, colocated: int,
                  gpu_count: int | None = None) -> dict[str, Any]:
    """Each worker's TP size and, on GPUs, its CUDA_VISIBLE_DEVICES (cluster/placement.py).
    Without -tp, --gpus or --share-gpus nothing is placed: every worker sees every GPU.
    With --transport cuda_ipc / auto the workers see the whole pool and each gets its
    `--device cuda:N` (peer access between GPUs needs both visible). `gpu_count`: the
    visible GPUs (default: torch's count)."""
    from cluster.placement import parse_gpus, plan, plan_cpu, visible_gpus

    tp = int(s.get("tensor_parallel_size") or 1)
    sizes = {"prefill": int(s.get("prefill_tensor_parallel_size") or tp),
             "decode": int(s.get("decode_tensor_parallel_size") or tp), "colocated": tp}
    if min(sizes.values()) < 1:
        raise ValueError("tensor parallel sizes must be >= 1")
    workers = [(f"{role}-{i}", role, sizes[role])
               for role, n in (("prefill", prefill), ("decode", decode),
                               ("colocated", colocated)) for i in range(n)]
    gpus = s.get("gpus")
    share = bool(s.get("share_gpus"))
    util = s.get("gpu_memory_utilization")
    if max(sizes.values()) == 1 and gpus is None and not share:
        if util is None:
            return {}
        return {wid: _util_only(("--gpu-memory-utilization", str(util)))
                for wid, _, _ in workers}
    device = str(s.get("device") or "auto")
    visible = [] if device == "cpu" else visible_gpus(gpu_count)
    if device == "cpu" or (device == "auto" and not visible):
        if gpus is not None or share:
            raise ValueError("--gpus / --share-gpus place workers on GPUs; the device is cpu")
        return dict(plan_cpu(workers))
    return dict(plan(workers, visible=visible,
                     gpus=parse_gpus(str(gpus)) if gpus is not None else None,
                     share=share, memory_utilization=util,
                     peer_view=str(s.get("transport") or "") in ("cuda_ipc", "auto")))


def _util_only(args: tuple[str, ...]) -> Any:
    from cluster.placement import WorkerPlacement

    return WorkerPlacement(args)


# Long enough (> the default decider threshold of 256 tokens) that a disaggregated
# cluster prefills it on the prefill worker and moves its KV to the decode worker.
DEMO_PROMPT = "The quick brown fox jumps over the lazy dog. " * 40


# Seeded sampling, not greedy: a random-weight model's greedy output collapses onto one
# repeated token, often a lone byte of a multi-byte character, which decodes to no text
# at all. `logprobs: 0` returns each generated token, so none is hidden.
DEMO_BODY = {"prompt": DEMO_PROMPT, "max_tokens": 24, "temperature": 0.8, "seed": 0,
             "logprobs": 0}


def demo_request(http_port: int, model: str, host: str = "127.0.0.1") -> dict[str, Any]:
    body = json.dumps({"model": model, **DEMO_BODY}).encode()
    req = urllib.request.Request(f"http://{host}:{http_port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def kv_summary(cluster: Any) -> str:
    """Where the demo's KV came from, read off the decode workers' /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    ok = moved = 0.0
    for child in cluster.children:
        if not child.name.startswith("decode") or "metrics_port" not in child.extra:
            continue
        url = f"http://{cluster.spec.host}:{child.extra['metrics_port']}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "splitserve:remote_prefill_total" and s.labels["outcome"] == "ok":
                    ok += s.value
                elif s.name == "splitserve:kv_transfer_bytes_total":
                    moved += s.value
    if not ok:
        return "the decode worker prefilled this prompt itself (no remote prefill)"
    return (f"prefilled on a prefill worker; {moved / 1024:.0f} KiB of KV moved to the decode "
            f"worker over {cluster.spec.transport}")


def gateway_lines(cluster: Any) -> str:
    """Where the admin key is, and the other gateways' ports when there are several."""
    out = (f"  admin API (/debug/workers, /admin/v1/*): Bearer key in "
           f"{cluster.admin_key_path}\n")
    if len(cluster.http_ports) > 1:
        out += (f"  all {len(cluster.http_ports)} gateways (one Redis; front them with a load "
                f"balancer): HTTP ports {cluster.http_ports[0]}-{cluster.http_ports[-1]}, "
                f"gRPC {cluster.grpc_ports[0]}-{cluster.grpc_ports[-1]}\n")
    return out


def run(args: argparse.Namespace) -> int:
    import os

    from cluster.errors import fail
    from cluster.launcher import ClusterError, LocalCluster

    spec = build_spec(args)  # a bad setting: cluster/cli.py prints its one line
    # Supervision events (exits, restarts) go to stderr with a time stamp.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cluster = LocalCluster(spec)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting redis, {spec.num_prefill} prefill, {spec.num_decode} decode, "
          f"{spec.num_colocated} colocated worker(s) and {spec.num_gateways} gateway(s) "
          f"(logs: {cluster.log_dir})",
          flush=True)
    for wid, place in spec.placement.items():
        if place.gpus:
            how = ("CUDA_VISIBLE_DEVICES" if "--device" not in place.args else
                   f"--device {place.args[place.args.index('--device') + 1]} of "
                   f"CUDA_VISIBLE_DEVICES={dict(place.env)['CUDA_VISIBLE_DEVICES']}")
            print(f"  {wid}: GPUs {','.join(place.gpus)} ({how})", flush=True)
    try:
        cluster.start()
    except ClusterError as e:
        return fail(str(e))
    model = os.path.basename(os.path.normpath(spec.model_dir))
    base = f"http://{spec.host}:{cluster.http_port}"
    print(f"\nsplitserve is up (model {model!r})\n  OpenAI HTTP: {base}/v1  (/v1/models, "
          f"/v1/completions, /v1/chat/completions, /health, /metrics)\n"
          f"  gRPC Generate: {spec.host}:{cluster.grpc_port}\n{gateway_lines(cluster)}"
          f"  redis: {cluster.redis_url}\n"
          f"  try: curl {base}/v1/completions -H 'Content-Type: application/json' "
          f"-d '{{\"prompt\": \"Hello\", \"max_tokens\": 16}}'\n  status (pids, restarts): "
          f"{cluster.status_path}\nCtrl-C stops everything.", flush=True)
    try:
        if args.demo_request:
            out = demo_request(cluster.http_port, model)
            print("\ndemo request: POST /v1/completions {\"prompt\": \"The quick brown fox "
                  "jumps over the lazy dog. \" * 40, " + json.dumps(
                      {k: v for k, v in DEMO_BODY.items() if k != "prompt"})[1:])
            tokens = [c.pop("logprobs")["tokens"] for c in out.get("choices", [])]
            print(json.dumps(out, indent=2, ensure_ascii=False))
            print(f"generated tokens: {tokens[0] if tokens else []}", flush=True)
            print(kv_summary(cluster), flush=True)
        while not stop.wait(0.2):
            cluster.supervise()
    except (ClusterError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        print("stopping...", flush=True)
        cluster.stop()
    return 0
