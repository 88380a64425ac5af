"""`disagg`: colocated vs disaggregated on the same two cores, same model, same workload.

- colocated: two colocated workers, pinned to core 0 and core 1; each serves whole
  requests, so a long prompt's prefill runs between the decode steps of the streams
  sharing its worker.
- disagg: a prefill worker on core 0 and a decode worker on core 1; the gateway sends
  prompts longer than the decider threshold to the prefill worker (short stream prompts
  are prefilled on the decode worker, as conditional disaggregation does).

Workload: streaming decodes (short prompt, long output) at a fixed concurrency, mixed
with long prompts (one or two output tokens) arriving at a constant rate. Phases:
`unloaded` (the streams alone, colocated), `colocated` and `disagg` (the mix). Headline:
the streams' TPOT p99 in each and TTFT p50 over all requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.clients import OpenAIClient
from bench.experiments.common import (
    ExperimentConfig,
    fixed,
    measure,
    phase_kw,
    pick,
    start_cluster,
    tokens,
)
from bench.experiments.transports import routing_yaml
from bench.load import LoadSpec
from bench.report import Report
from bench.runner import Phase, run_mixed, run_phase


@dataclass(frozen=True, slots=True)
class DisaggWorkload:
    streams: int = 16  # decode streams (requests)
    stream_concurrency: int = 4
    stream_prompt: int = 64
    stream_output: int = 64
    longs: int = 12
    long_prompt: int = 1536
    long_output: int = 2
    long_rate: float = 1.0  # long prompts per second
    threshold: int = 256  # decider: prompts with more uncached tokens go to prefill

    @classmethod
    def quick(cls) -> DisaggWorkload:
        return cls(streams=4, stream_concurrency=2, stream_prompt=24, stream_output=10,
                   longs=3, long_prompt=320, long_output=2, long_rate=4.0, threshold=64)


def run(cfg: ExperimentConfig) -> Report:
    w = DisaggWorkload.quick() if cfg.quick else DisaggWorkload()
    pool = tokens(cfg)
    streams = fixed(pool, w.streams, w.stream_prompt, w.stream_output, cfg.seed, "stream")
    longs = fixed(pool, w.longs, w.long_prompt, w.long_output, cfg.seed + 1, "long")
    stream_load = LoadSpec("concurrency", concurrency=w.stream_concurrency)
    long_load = LoadSpec("constant", rate=w.long_rate)
    mix = [(streams, stream_load), (longs, long_load)]
    kw = phase_kw(cfg)
    routing = ("--routing", routing_yaml(cfg, w.threshold))
    phases: list[Phase] = []

    async def colocated(client: OpenAIClient) -> list[Phase]:
        unloaded = await run_phase(client, streams, stream_load, name="unloaded",
                                   config="colocated", **kw)
        mixed = await run_mixed(client, mix, name="colocated", config="colocated", **kw)
        return [unloaded, mixed]

    async def disagg(client: OpenAIClient) -> list[Phase]:
        return [await run_mixed(client, mix, name="disagg", config="disagg", **kw)]

    with start_cluster(cfg, colocated=2, pins={"colocated-0": "0", "colocated-1": "1"},
                       gateway_args=routing) as cluster:
        phases += measure(cfg, cluster, colocated)[0]
    with start_cluster(cfg, prefill=1, decode=1, pins={"prefill-0": "0", "decode-0": "1"},
                       gateway_args=routing) as cluster:
        measured, grew = measure(cfg, cluster, disagg, warm_prompt_len=w.threshold + 16,
                                 metrics_ports=cluster.worker_metrics_ports("decode"))
        phases += measured
        remote = grew.get("splitserve:remote_prefill_total", 0.0)
    return Report("disagg", "Colocated vs disaggregated prefill/decode (2 cores)", phases,
                  summary=_summary(phases, remote), config={"workload": _asdict(w)},
                  notes=_notes(w, remote))


def _summary(phases: list[Phase], remote: float) -> dict[str, Any]:
    by = {p.name: p for p in phases}

    def stream_tpot(name: str) -> float | None:
        p = by[name]
        return pick(p.tags.get("stream", p.summary), "tpot_s", "p99")

    out = {"tpot_p99_colocated": stream_tpot("colocated"),
           "tpot_p99_disagg": stream_tpot("disagg"),
           "tpot_p99_unloaded": stream_tpot("unloaded"),
           "ttft_p50_colocated": pick(by["colocated"].summary, "ttft_s", "p50"),
           "ttft_p50_disagg": pick(by["disagg"].summary, "ttft_s", "p50")}
    for name in ("colocated", "disagg"):
        long = by[name].tags.get("long")
        out[f"ttft_p50_long_{name}"] = pick(long, "ttft_s", "p50") if long else None
    out["remote_prefills"] = int(remote)
    out["failed_requests"] = sum(p.summary["failed"] for p in phases)
    return out


def _notes(w: DisaggWorkload, remote: float) -> list[str]:
    return [f"streams: {w.streams} requests of {w.stream_prompt} prompt + {w.stream_output} "
            f"output tokens at concurrency {w.stream_concurrency}; long prompts: {w.longs} of "
            f"{w.long_prompt} tokens ({w.long_output} output) at {w.long_rate:g} req/s.",
            "TPOT figures are the streams' (tag `stream`); TTFT p50 is over all requests.",
            f"disagg: decider threshold {w.threshold} uncached tokens; the decode worker "
            f"counted {int(remote)} remote prefills.",
            "The gateway, redis and the load generator are not pinned and share both cores."]


def _asdict(w: DisaggWorkload) -> dict[str, Any]:
    return {k: getattr(w, k) for k in w.__dataclass_fields__}
