"""`fairness`: tenants sharing a worker through the gateway's admission queue — FCFS
against VTC, and a scheduling strategy replaced live mid-run.

Cluster: one colocated worker (few sequences at once) behind a gateway that lets at
most one request wait on the worker; what does not fit waits in the gateway's
admission queue, whose order is what the phases compare. Tenants are API keys mapped
to tenants (`--tenants`).

Phases:
- `solo`: the light tenant alone — its TTFT without contention.
- `fcfs` / `vtc`: a heavy tenant at `heavy_x` times the light one's rate, together past
  the worker's capacity, under `--admission-order fcfs` then `vtc` (separate clusters,
  same workload).
- `live`: two backlogged tenants `a` and `b` (equal weights) and the light one under
  VTC; halfway, `POST /api/v1/scheduling/strategies` gives `a` weight `live_weight`.

Headline: the light tenant's TTFT p50 per phase against solo; in `live`, `a`'s share of
the service `a` and `b` received before and after the change. Service is VTC's measure:
prompt tokens + 2 x output tokens (a request's output counted evenly between its first
and last token).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

from bench.base import BenchError, BenchRequest, RequestResult
from bench.clients import OpenAIClient
from bench.experiments.common import (
    ExperimentConfig,
    fixed,
    phase_kw,
    pick,
    start_cluster,
    tokens,
)
from bench.load import LoadSpec
from bench.report import Report
from bench.runner import Phase, run_mixed

ADMIN_KEY = "fairness-admin-key"
OUTPUT_COST = 2.0  # VTC's w_q (gateway/admission.py)


@dataclass(frozen=True, slots=True)
class FairnessWorkload:
    prompt: int = 32
    output: int = 32
    light_rate: float = 1.2  # req/s
    heavy_x: float = 10.0  # the heavy tenant's rate / the light one's
    duration_s: float = 24.0  # arrivals per phase
    live_rate: float = 8.0  # req/s of each of `a` and `b`
    live_weight: float = 3.0
    max_num_seqs: int = 2
    window_s: float = 2.0  # service-rate bins in the plots

    @classmethod
    def quick(cls) -> FairnessWorkload:
        return cls(prompt=16, output=8, duration_s=4.0, light_rate=3.0, live_rate=15.0)


class TenantClients:
    """One OpenAI client per tenant (its API key); a request is sent as the tenant its
    tag names."""

    name = "openai"

    def __init__(self, url: str, keys: dict[str, str], timeout_s: float) -> None:
        self.clients = {t: OpenAIClient(url, api_key=k, timeout_s=timeout_s)
                        for t, k in keys.items()}

    async def send(self, req: BenchRequest) -> RequestResult:
        return await self.clients[req.tag].send(req)

    async def close(self) -> None:
        for c in self.clients.values():
            await c.close()


def _tenants_file(cfg: ExperimentConfig, tenants: list[str]) -> tuple[str, dict[str, str]]:
    keys = {t: f"key-{t}-0123" for t in tenants}
    path = os.path.join(os.path.abspath(cfg.out_dir), "fairness-tenants.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"keys": {k: {"tenant": t} for t, k in keys.items()}}, f)
    return path, keys


def _requests(cfg: ExperimentConfig, w: FairnessWorkload, tenant: str, rate: float,
              seed: int) -> tuple[list[BenchRequest], LoadSpec]:
    n = max(2, round(rate * w.duration_s))
    reqs = fixed(tokens(cfg), n, w.prompt, w.output, cfg.seed + seed, tenant)
    return reqs, LoadSpec("poisson", rate=rate, seed=cfg.seed + seed)


def _post_strategies(url: str, doc: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url + "/api/v1/scheduling/strategies", data=json.dumps(doc).encode(), method="POST",
        headers={"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return dict(json.loads(r.read()))


def run(cfg: ExperimentConfig) -> Report:
    w = FairnessWorkload.quick() if cfg.quick else FairnessWorkload()
    tenants_path, keys = _tenants_file(cfg, ["light", "heavy", "a", "b"])
    light = _requests(cfg, w, "light", w.light_rate, 1)
    heavy = _requests(cfg, w, "heavy", w.light_rate * w.heavy_x, 2)
    kw = phase_kw(cfg)
    phases: list[Phase] = []
    live_change: dict[str, Any] = {}

    def gateway_args(order: str) -> tuple[str, ...]:
        return ("--tenants", tenants_path, "--admin-key", ADMIN_KEY, "--admission-order",
                order, "--max-waiting-per-worker", "1", "--admission-queue", "4096",
                "--request-timeout", str(cfg.request_timeout_s), "--strategies-poll", "0.5")

    async def drive(url: str, body: Any) -> list[Phase]:
        client = TenantClients(url, keys, cfg.request_timeout_s)
        try:
            warm = fixed(tokens(cfg), 4, w.prompt, 2, cfg.seed + 99, "light")
            phase = await run_mixed(client, [(warm, LoadSpec("concurrency", concurrency=2))],
                                    name="warm-up", progress=False, timeout_s=60.0)
            if phase.summary["failed"]:
                raise BenchError(f"warm-up failed: {phase.summary['errors']}")
            return list(await body(client, url))
        finally:
            await client.close()

    async def fcfs(client: TenantClients, url: str) -> list[Phase]:
        solo = await run_mixed(client, [light], name="solo", config="fcfs", **kw)
        both = await run_mixed(client, [light, heavy], name="fcfs", config="fcfs", **kw)
        return [solo, both]

    async def vtc(client: TenantClients, url: str) -> list[Phase]:
        both = await run_mixed(client, [light, heavy], name="vtc", config="vtc", **kw)
        a = _requests(cfg, w, "a", w.live_rate, 3)
        b = _requests(cfg, w, "b", w.live_rate, 4)

        async def change() -> None:
            await asyncio.sleep(w.duration_s / 2)
            doc = {"scheduling": [{"weight": w.live_weight,
                                   "selectors": [{"key": "tenant", "value": "a"}]}]}
            live_change["at_s"] = time.perf_counter() - t0
            live_change.update(await asyncio.to_thread(_post_strategies, url, doc))

        t0 = time.perf_counter()
        live, _ = await asyncio.gather(
            run_mixed(client, [light, a, b], name="live", config="vtc", **kw), change())
        return [both, live]

    for order, body in (("fcfs", fcfs), ("vtc", vtc)):
        with start_cluster(cfg, colocated=1, pins={"colocated-0": "0"},
                           gateway_args=gateway_args(order),
                           worker_args=("--max-num-seqs", str(w.max_num_seqs))) as cluster:
            phases += asyncio.run(drive(cluster.url, body))
    change_at = float(live_change.get("at_s", w.duration_s / 2))
    summary = _summary(phases, w, change_at)
    return Report("fairness", "Tenants through the admission queue: FCFS vs VTC, and a "
                  "strategy changed live", phases, summary=summary,
                  config={"workload": asdict(w), "live_strategies": live_change},
                  notes=_notes(w, summary, live_change),
                  plotters=[lambda out, stem: plot_over_time(phases, w, change_at, out, stem)])


def service_rate(results: list[RequestResult], tenant: str, t_from: float, t_to: float,
                 ) -> float:
    """VTC service (prompt + 2 x output tokens) per second the tenant received between
    t_from and t_to (phase seconds); a request's output is spread evenly over its
    stream, its prompt counted at its first token."""
    total = 0.0
    for r in results:
        if not r.ok or r.tag != tenant or r.ttft_s is None or r.e2e_s is None:
            continue
        first, last = r.start_s + r.ttft_s, r.start_s + r.e2e_s
        if t_from <= first < t_to:
            total += r.prompt_len
        span = max(last - first, 1e-9)
        overlap = max(0.0, min(last, t_to) - max(first, t_from))
        total += OUTPUT_COST * r.output_len * (overlap / span if last > first else
                                               float(t_from <= first < t_to))
    return total / max(t_to - t_from, 1e-9)


def _summary(phases: list[Phase], w: FairnessWorkload, change_at: float) -> dict[str, Any]:
    by = {p.name: p for p in phases}
    out: dict[str, Any] = {}
    solo = pick(by["solo"].summary, "ttft_s", "p50")
    for name in ("solo", "fcfs", "vtc", "live"):
        s = by[name].tags.get("light", by[name].summary)
        out[f"light_ttft_p50_{name}"] = pick(s, "ttft_s", "p50") if s else None
    for name in ("fcfs", "vtc"):
        v = out[f"light_ttft_p50_{name}"]
        out[f"light_ttft_x_solo_{name}"] = round(v / solo, 2) if v and solo else None
        heavy = by[name].tags.get("heavy")
        out[f"heavy_ttft_p50_{name}"] = pick(heavy, "ttft_s", "p50") if heavy else None
        out[f"output_tok_s_{name}"] = round(by[name].summary["output_throughput"], 1)
    live = by["live"].results
    end = w.duration_s
    for label, (lo, hi) in (("before", (1.0, change_at)), ("after", (change_at + 1.0, end))):
        a = service_rate(live, "a", lo, hi)
        b = service_rate(live, "b", lo, hi)
        out[f"live_share_a_{label}"] = round(a / (a + b), 3) if a + b > 0 else None
    out["live_target_share_a_after"] = round(w.live_weight / (w.live_weight + 1), 3)
    out["failed_requests"] = sum(p.summary["failed"] for p in phases)
    return out


def _notes(w: FairnessWorkload, s: dict[str, Any], change: dict[str, Any]) -> list[str]:
    return [
        f"One colocated worker (max {w.max_num_seqs} sequences) pinned to core 0; the gateway "
        "lets one request wait on it and queues the rest (`--max-waiting-per-worker 1`). "
        f"Requests: {w.prompt} prompt + {w.output} output tokens, Poisson arrivals for "
        f"{w.duration_s:g} s.",
        f"`fcfs`/`vtc`: light {w.light_rate:g} req/s + heavy {w.light_rate * w.heavy_x:g} "
        f"req/s. The light tenant's TTFT p50 is {s['light_ttft_x_solo_fcfs']}x its solo value "
        f"under FCFS and {s['light_ttft_x_solo_vtc']}x under VTC: under VTC it is next "
        "in the gateway's queue, but still waits for one of the worker's sequences to "
        "finish and for the one request already waiting there (solo: an idle worker).",
        f"`live`: tenants a and b at {w.live_rate:g} req/s each (together past capacity) "
        f"and light; at {change.get('at_s', 0):.1f} s the strategies became version "
        f"{change.get('version')} (a: weight {w.live_weight:g}). a's share of a+b's service: "
        f"{s['live_share_a_before']} before, {s['live_share_a_after']} after (target "
        f"{s['live_target_share_a_after']}).",
        "The gateway, redis and the load generator share core 1 (2-core machine shared with "
        "other work: absolute latencies are noisy, the ratios are the result)."]


def plot_over_time(phases: list[Phase], w: FairnessWorkload, change_at: float, out_dir: str,
                   stem: str) -> str | None:
    """Per tenant: service rate and TTFT over the phase, one row per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [p for p in phases if p.name in ("fcfs", "vtc", "live")]
    if not shown:
        return None
    fig, axes = plt.subplots(len(shown), 2, figsize=(12, 3.4 * len(shown)), squeeze=False)
    for row, p in zip(axes, shown, strict=True):
        tenants = sorted({r.tag for r in p.results})
        end = max((r.start_s + (r.e2e_s or 0.0) for r in p.results if r.ok), default=1.0)
        edges = [i * w.window_s for i in range(int(end / w.window_s) + 2)]
        for i, t in enumerate(tenants):
            rates = [service_rate(p.results, t, lo, lo + w.window_s) for lo in edges[:-1]]
            row[0].step(edges[:-1], rates, where="post", label=t, color=f"C{i}")
            pts = [(r.start_s, r.ttft_s) for r in p.results if r.ok and r.tag == t]
            row[1].scatter([x for x, _ in pts], [y for _, y in pts], s=8, label=t,
                           color=f"C{i}")
        for ax in row:
            if p.name == "live":
                ax.axvline(change_at, color="k", ls="--", lw=1, label="weight change")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            ax.set_xlabel("seconds into the phase")
        row[0].set_ylabel("service (tokens/s)")
        row[0].set_title(f"{p.name}: service per tenant (prompt + 2 x output, "
                         f"{w.window_s:g} s bins)")
        row[1].set_ylabel("TTFT (s)")
        row[1].set_yscale("log")
        row[1].set_title(f"{p.name}: TTFT by arrival time")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{stem}-over-time.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
