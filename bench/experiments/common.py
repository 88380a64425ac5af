"""What every experiment shares: its config, a LocalCluster whose workers are pinned to
cores, waiting until the gateway routes to every worker, measuring phases over the
OpenAI HTTP API, and reading worker Prometheus counters.

Ownership: an experiment owns each cluster it starts (a context manager: it is stopped
before the next configuration starts, so configurations never share the machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from bench.base import BenchError, BenchRequest
from bench.clients import OpenAIClient
from bench.datasets import LengthDist, TokenPool, synthetic
from bench.load import LoadSpec
from bench.runner import Phase, run_phase
from cluster.gateways import debug_workers
from cluster.launcher import ClusterSpec, LocalCluster


@dataclass(frozen=True, slots=True)
class ExperimentConfig:
    model_dir: str
    out_dir: str
    quick: bool = False  # a few-second version (the test suite runs it)
    seed: int = 0
    progress: bool = True
    phase_timeout_s: float = 600.0
    request_timeout_s: float = 120.0
    transports: tuple[str, ...] = ("ucx", "tcp", "shm")
    slo: tuple[tuple[str, float], ...] = ()
    profiles: tuple[str, ...] = ()  # routing experiment: extra routing YAML files
    trace_path: str = ""  # routing experiment: a Mooncake JSONL (default: the shared one)
    device: str = "cpu"  # transports experiment: "cuda" runs its workers on one GPU
    load_format: str = "auto"  # "dummy" for a model shape (random weights on the device)

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(self.model_dir, "config.json")):
            raise BenchError(f"{self.model_dir!r} is not a model directory (no config.json)")
        if self.phase_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise BenchError("timeouts must be > 0")


class PinnedCluster(LocalCluster):
    """A LocalCluster whose children named in `pins` (e.g. {"prefill-0": "0"}) run
    through `bench.pin`, so each is confined to its cores with one thread per core."""

    def __init__(self, spec: ClusterSpec, pins: dict[str, str]) -> None:
        super().__init__(spec)
        self.pins = pins

    def spawn(self, name: str, argv: list[str], grpc_address: str | None = None) -> Any:
        if name in self.pins:
            argv = [sys.executable, "-m", "bench.pin", self.pins[name], "--", *argv]
        return super().spawn(name, argv, grpc_address)

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.http_port}"

    def worker_metrics_ports(self, role_prefix: str = "") -> list[int]:
        return [int(c.extra["metrics_port"]) for c in self.children
                if "metrics_port" in c.extra and c.name.startswith(role_prefix)]


@contextlib.contextmanager
def start_cluster(cfg: ExperimentConfig, *, prefill: int = 0, decode: int = 0,
                  colocated: int = 0, transport: str = "tcp", pins: dict[str, str] | None = None,
                  gateway_args: tuple[str, ...] = (), worker_args: tuple[str, ...] = (),
                  ) -> Iterator[PinnedCluster]:
    """Starts the cluster, waits until the gateway can route to all its workers, yields
    it and stops it."""
    spec = ClusterSpec(cfg.model_dir, num_prefill=prefill, num_decode=decode,
                       num_colocated=colocated, transport=transport,
                       worker_args=("--max-model-len", "2048", *worker_args),
                       gateway_args=gateway_args,
                       log_dir=os.path.join(cfg.out_dir, "logs", f"{int(time.time() * 1e3)}"))
    from bench.pin import parse_cores

    for name, cores in (pins or {}).items():
        try:
            parse_cores(cores)
        except ValueError as e:
            raise BenchError(f"this experiment pins {name} to core(s) {cores}, but {e}") from e
    cluster = PinnedCluster(spec, pins or {})
    cluster.start()
    try:
        wait_routable(cluster, prefill + decode + colocated)
        yield cluster
    finally:
        cluster.stop()


def wait_routable(cluster: PinnedCluster, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            seen = debug_workers(cluster.spec.host, cluster.http_port, cluster.admin_key)
        except OSError:
            seen = []
        if sum(bool(w.get("routable")) for w in seen) >= n:
            return
        cluster.check_alive()
        time.sleep(0.2)
    raise BenchError(f"the gateway saw {len(seen)} routable of {n} workers after "
                     f"{timeout_s:.0f} s (logs in {cluster.log_dir})")


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """A /metrics page as {sample name: value summed over labels}."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5.0) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def scrape_all(ports: list[int]) -> dict[str, float]:
    total: dict[str, float] = {}
    for port in ports:
        for k, v in scrape(port).items():
            total[k] = total.get(k, 0.0) + v
    return total


def measure(cfg: ExperimentConfig, cluster: PinnedCluster,
            body: Callable[[OpenAIClient], Awaitable[list[Phase]]],
            warm_prompt_len: int = 16, metrics_ports: list[int] | None = None,
            token_chunks: bool | None = None) -> tuple[list[Phase], dict[str, float]]:
    """Runs `body(client)` with an OpenAI client on the cluster's gateway, after a
    warm-up of two short requests per worker (not measured; make `warm_prompt_len`
    longer than the decider threshold to warm the remote-prefill path too). Returns the
    phases and how much each metric of `metrics_ports` grew during `body`.
    `token_chunks`: the client times tokens, not text (OpenAIClient); None: only for
    dummy weights, which mostly sample ids without text."""

    async def main() -> tuple[list[Phase], dict[str, float]]:
        chunks = cfg.load_format == "dummy" if token_chunks is None else token_chunks
        client = OpenAIClient(cluster.url, timeout_s=cfg.request_timeout_s,
                              token_chunks=chunks)
        try:
            pool = TokenPool.from_tokenizer_dir(cfg.model_dir, cfg.seed)
            n_warm = 2 * max(1, len(cluster.worker_metrics_ports()))
            warm = synthetic(pool, n_warm, LengthDist(mean=warm_prompt_len),
                             LengthDist(mean=2), seed=cfg.seed + 99)
            phase = await run_phase(client, warm, LoadSpec("concurrency", concurrency=2),
                                    name="warm-up", progress=False, timeout_s=60.0)
            if phase.summary["failed"]:
                raise BenchError(f"warm-up failed: {phase.summary['errors']} "
                                 f"(logs in {cluster.log_dir})")
            before = scrape_all(metrics_ports or [])
            phases = await body(client)
            after = scrape_all(metrics_ports or [])
            return phases, {k: v - before.get(k, 0.0) for k, v in after.items()}
        finally:
            await client.close()

    return asyncio.run(main())


def phase_kw(cfg: ExperimentConfig) -> dict[str, Any]:
    return {"progress": cfg.progress, "timeout_s": cfg.phase_timeout_s,
            "slo": dict(cfg.slo) or None}


def tokens(cfg: ExperimentConfig) -> TokenPool:
    return TokenPool.from_tokenizer_dir(cfg.model_dir, cfg.seed)


def fixed(pool: TokenPool, n: int, prompt_len: int, output_len: int, seed: int,
          tag: str) -> list[BenchRequest]:
    return synthetic(pool, n, LengthDist(mean=prompt_len), LengthDist(mean=output_len),
                     seed=seed, tag=tag)


def pick(summary: dict[str, Any], metric: str, q: str) -> float | None:
    v = summary[metric][q]
    return None if v is None else round(float(v), 6)
