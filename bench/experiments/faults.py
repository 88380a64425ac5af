"""`faults`: one disaggregated cluster per fault kind that kvtransfer/faults.py and
worker/faults.py inject, the same greedy requests through each, against a fault-free
run.

Cluster: one prefill and one decode worker (tcp transport, per-block checksums, a 2 s
KV lease, a 4 s prefill timeout, small prefill chunks so one prompt's KV travels as
several WRITE frames), every prompt prefilled remotely (decider threshold 0). Wire and
RPC kinds fire on every worker with the probability given; `kill.write` SIGKILLs the
prefill at its Nth WRITE frame (it stays down: the decode prefills locally from then);
`kill.token` SIGKILLs one of two decode workers as a stream reaches output token N (the
gateway resumes the stream on the other).

Per kind: requests that succeeded with the fault-free run's tokens, that got a wrong
output (must be 0), that failed cleanly (a gRPC status with a message, within the
deadline), that hung (ended only by the client's deadline); latency p50/p99 of the
successful ones against the fault-free run; KV blocks not free once idle on every
surviving worker (must be 0); faults the workers counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from bench.experiments.common import ExperimentConfig, PinnedCluster, scrape_all, wait_routable
from bench.invariants import idle_blocks
from bench.report import Report
from cluster.launcher import ClusterSpec, LocalCluster
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc

DEADLINE_S = 15.0
MAX_TOKENS = 8
ALWAYS_REMOTE = ("routing:\n  scorers: [{name: queue, weight: 1.0}]\n  picker: max_score\n"
                 "  decider: {name: threshold, threshold: 0}\n")
WORKER_ARGS = ("--num-blocks", "96", "--max-num-batched-tokens", "32", "--kv-checksum",
               "--kv-lease", "2", "--prefill-timeout", "4")


@dataclass(frozen=True, slots=True)
class FaultKind:
    name: str
    spec: str  # kvtransfer/faults.py's syntax, for every worker ("" with `target`)
    target: str = ""  # one worker gets `spec` alone (the kills)
    decode: int = 1


KINDS = (
    FaultKind("none", ""),
    FaultKind("wire.drop", "wire.drop=0.15"),
    FaultKind("wire.delay", "wire.delay=0.5,delay=0.05"),
    FaultKind("wire.duplicate", "wire.duplicate=0.3"),
    FaultKind("wire.reorder", "wire.reorder=0.5"),
    FaultKind("wire.corrupt", "wire.corrupt=0.15"),
    FaultKind("wire.truncate", "wire.truncate=0.1"),
    FaultKind("rpc.drop", "rpc.drop=0.2"),
    FaultKind("rpc.delay", "rpc.delay=0.5,delay=0.05"),
    FaultKind("rpc.duplicate", "rpc.duplicate=0.3,delay=0.05"),
    FaultKind("kill.write", "kill.write=5", target="prefill-0"),
    FaultKind("kill.token", "kill.token=4", target="decode-0", decode=2),
)


class FaultCluster(PinnedCluster):
    """A cluster whose worker `target` alone is started with `--faults spec`."""

    def __init__(self, spec: ClusterSpec, target: str, faults: str) -> None:
        super().__init__(spec, {})
        self.target, self.faults = target, faults

    def spawn(self, name: str, argv: list[str], grpc_address: str | None = None) -> Any:
        if name == self.target:
            argv = [*argv, "--faults", self.faults]
        return super().spawn(name, argv, grpc_address)


@contextlib.contextmanager
def fault_cluster(cfg: ExperimentConfig, kind: FaultKind, seed: int) -> Iterator[FaultCluster]:
    out = os.path.abspath(cfg.out_dir)
    os.makedirs(out, exist_ok=True)
    routing = os.path.join(out, "faults-routing.yaml")
    with open(routing, "w") as f:
        f.write(ALWAYS_REMOTE)
    every = ("--faults", f"seed={seed},{kind.spec}") if kind.spec and not kind.target else ()
    spec = ClusterSpec(cfg.model_dir, num_prefill=1, num_decode=kind.decode, num_colocated=0,
                       transport="tcp", worker_args=(*WORKER_ARGS, *every),
                       gateway_args=("--routing", routing),
                       log_dir=os.path.join(out, "logs", f"faults-{kind.name}"))
    cluster = FaultCluster(spec, kind.target, f"seed={seed},{kind.spec}")
    cluster.start()
    try:
        wait_routable(cluster, 1 + kind.decode)
        yield cluster
    finally:
        cluster.stop()


@dataclass(frozen=True, slots=True)
class Outcome:
    tokens: list[int] | None
    code: str | None  # the gRPC status of a failure
    seconds: float


def prompts(n: int, seed: int) -> list[list[int]]:
    return [[(17 * j + 31 * i + seed) % 450 + 3 for j in range(24 + 9 * (i % 6))]
            for i in range(n)]


def send_all(cluster: LocalCluster, batch: list[list[int]], concurrency: int,
             max_tokens: int = MAX_TOKENS, deadline_s: float = DEADLINE_S) -> list[Outcome]:
    """Greedy gRPC Generate of each prompt through the gateway, `concurrency` at once
    (also the fault tests' client, tests/integration/test_faults.py)."""
    async def main() -> list[Outcome]:
        gate = asyncio.Semaphore(concurrency)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
            stub = pb_grpc.GenerateStub(ch)

            async def one(p: list[int]) -> Outcome:
                async with gate:
                    t0 = time.monotonic()
                    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), sampling=pb.
                                             SamplingParams(max_tokens=max_tokens,
                                                            temperature=0.0, ignore_eos=True))
                    try:
                        out = [t async for r in stub.Generate(req, timeout=deadline_s)
                               for t in r.token_ids]
                        return Outcome(out, None, time.monotonic() - t0)
                    except grpc.aio.AioRpcError as e:
                        code = e.code().name if e.details() else f"{e.code().name} (no message)"
                        return Outcome(None, code, time.monotonic() - t0)
            return list(await asyncio.gather(*(one(p) for p in batch)))
    return asyncio.run(main())


def _q(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def measure(cfg: ExperimentConfig, kind: FaultKind, batch: list[list[int]],
            ref: list[list[int]] | None, concurrency: int) -> dict[str, Any]:
    with fault_cluster(cfg, kind, cfg.seed + 7) as cluster:
        send_all(cluster, batch[:2], 2)  # warm-up (both paths' first-call costs)
        outs = send_all(cluster, batch, concurrency)
        blocks = idle_blocks(cluster)
        alive = [c for c in cluster.children if c.proc.poll() is None]
        injected = scrape_all([int(c.extra["metrics_port"]) for c in alive
                               if "metrics_port" in c.extra])
        killed = sum(c.proc.poll() == -9 for c in cluster.children)
    expected = ref or [o.tokens or [] for o in outs]
    ok = [o for o, r in zip(outs, expected, strict=True) if o.tokens is not None
          and o.tokens == r]
    hung = [o for o in outs if o.tokens is None and o.seconds >= DEADLINE_S - 0.05]
    fired = killed + sum(v for k, v in injected.items()
                         if k.endswith("_faults_injected_total"))
    return {"kind": kind.name, "spec": kind.spec, "requests": len(outs),
            "succeeded": len(ok),
            "wrong": sum(o.tokens is not None and o.tokens != r
                         for o, r in zip(outs, expected, strict=True)),
            "failed_cleanly": sum(o.tokens is None for o in outs) - len(hung),
            "hung": len(hung),
            "errors": sorted({o.code for o in outs if o.code}),
            "p50_s": _q([o.seconds for o in ok], 0.5), "p99_s": _q([o.seconds for o in ok], 0.99),
            "leaked_blocks": sum(max(b.leaked, 0) for b in blocks.values()),
            "faults_fired": int(fired), "tokens": [o.tokens for o in outs]}


def table(rows: list[dict[str, Any]]) -> list[str]:
    base = rows[0]
    lines = ["| fault | spec | requests | succeeded | wrong | failed cleanly | hung | "
             "p50 / p99 s | p50 vs none | leaked blocks | faults fired | errors |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in rows:
        lat = "-" if r["p50_s"] is None else f"{r['p50_s']:.2f} / {r['p99_s']:.2f}"
        ratio = "-" if r["p50_s"] is None or not base["p50_s"] \
            else f"{r['p50_s'] / base['p50_s']:.1f}x"
        lines.append(f"| {r['kind']} | `{r['spec'] or '-'}` | {r['requests']} | "
                     f"{r['succeeded']} ({r['succeeded'] / r['requests']:.0%}) | {r['wrong']} | "
                     f"{r['failed_cleanly']} | {r['hung']} | {lat} | {ratio} | "
                     f"{r['leaked_blocks']} | {r['faults_fired']} | "
                     f"{', '.join(r['errors']) or '-'} |")
    return lines


def run(cfg: ExperimentConfig) -> Report:
    n, concurrency = (8, 4) if cfg.quick else (32, 4)
    kinds = KINDS[:2] + KINDS[-2:] if cfg.quick else KINDS
    batch = prompts(n, cfg.seed)
    rows: list[dict[str, Any]] = []
    for kind in kinds:
        rows.append(measure(cfg, kind, batch, rows[0]["tokens"] if rows else None,
                            concurrency))
        if rows[0]["succeeded"] < n:
            raise ValueError(f"the fault-free run failed {n - rows[0]['succeeded']} of {n} "
                             f"requests (logs in {cfg.out_dir}/logs)")
    faulty = rows[1:]
    summary: dict[str, Any] = {
        "success_rate_min": round(min(r["succeeded"] / r["requests"] for r in faulty), 3),
        "success_rate_mean": round(sum(r["succeeded"] / r["requests"] for r in faulty)
                                   / len(faulty), 3),
        "wrong_outputs": sum(r["wrong"] for r in rows),
        "hung_requests": sum(r["hung"] for r in rows),
        "leaked_blocks": sum(r["leaked_blocks"] for r in rows),
        "p50_none_s": rows[0]["p50_s"]}
    notes = [f"{n} greedy requests ({MAX_TOKENS} tokens, prompts of 24-69 tokens) per kind at "
             f"concurrency {concurrency} through the gateway's gRPC Generate, deadline "
             f"{DEADLINE_S:g} s; one fresh cluster per kind (1 prefill + 1 decode, tcp, "
             "checksums, 2 s lease, 4 s prefill timeout; kill.token: 2 decode workers).",
             "succeeded: the fault-free run's tokens exactly; wrong: other tokens; failed "
             "cleanly: a gRPC status with a message before the deadline; hung: ended only by "
             "the client's deadline.",
             "faults fired: what the workers counted (splitserve:{wire,rpc}_faults_injected"
             "_total), plus 1 per worker found SIGKILLed; killed workers are not restarted "
             "(no supervision), so the rest of the run goes on without them."]
    for r in rows:
        r.pop("tokens")
    return Report(name="faults", title="Fault injection on the KV path and worker RPCs",
                  phases=[], summary=summary, notes=notes, tables=[table(rows)],
                  config={"kinds": rows, "requests_per_kind": n, "concurrency": concurrency,
                          "deadline_s": DEADLINE_S, "worker_args": list(WORKER_ARGS),
                          "seed": cfg.seed})
