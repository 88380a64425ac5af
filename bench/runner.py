"""Runs one phase: a workload under one load shape against one client, with a progress
bar and a deadline, and returns the measured `Phase`.

Ownership: the caller owns the client (opens and closes it); `run_phase` owns the
tasks it starts and cancels them at the deadline; requests that had not finished by
then count as failed ("phase deadline"), so a stalled server shows as errors.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from bench.base import BenchRequest, Client, RequestResult
from bench.load import LoadSpec, start_offsets, units
from bench.metrics import by_tag, summarize


@dataclass(slots=True)
class Phase:
    """One measured phase: `name` labels it in reports; `params` are the x-values plots
    use (e.g. {"rate": 2.0}); `config` names the cluster configuration measured."""

    name: str
    load: str
    results: list[RequestResult]
    summary: dict[str, Any]
    tags: dict[str, dict[str, Any]] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    config: str = ""

    def to_json(self, with_requests: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "config": self.config, "load": self.load,
                               "params": self.params, "summary": self.summary}
        if self.tags:
            out["by_tag"] = self.tags
        if with_requests:
            out["requests"] = [{
                "ok": r.ok, "tag": r.tag, "start_s": round(r.start_s, 6),
                "prompt_len": r.prompt_len, "output_len": r.output_len,
                "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "e2e_s": r.e2e_s,
                "cached_tokens": r.cached_tokens, "error": r.error} for r in self.results]
        return out


async def run_phase(client: Client, requests: list[BenchRequest], load: LoadSpec, *,
                    name: str, slo: dict[str, float] | None = None, progress: bool = True,
                    timeout_s: float = 600.0, params: dict[str, Any] | None = None,
                    config: str = "") -> Phase:
    """One workload under one load shape."""
    return await run_mixed(client, [(requests, load)], name=name, slo=slo, progress=progress,
                           timeout_s=timeout_s, params=params, config=config)


async def run_mixed(client: Client, streams: list[tuple[list[BenchRequest], LoadSpec]], *,
                    name: str, slo: dict[str, float] | None = None, progress: bool = True,
                    timeout_s: float = 600.0, params: dict[str, Any] | None = None,
                    config: str = "") -> Phase:
    """Several workloads, each under its own load shape, at the same time (e.g. streaming
    decodes at fixed concurrency while long prompts arrive at a rate); one phase."""
    from tqdm import tqdm

    requests = [r for reqs, _ in streams for r in reqs]
    results: list[RequestResult] = []
    finished: set[int] = set()
    bar = tqdm(total=len(requests), desc=name, unit="req", leave=False, file=sys.stderr,
               disable=not progress)
    t0 = time.perf_counter()

    def stream_tasks(reqs: list[BenchRequest], load: LoadSpec) -> list[asyncio.Task[None]]:
        work = units(reqs)
        offsets = start_offsets(load, work)
        limit = load.concurrency if offsets is None else (load.max_concurrency or len(work))
        sem = asyncio.Semaphore(max(1, limit))

        async def run_unit(i: int, unit: list[BenchRequest]) -> None:
            if offsets is not None:
                await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            async with sem:
                for req in unit:  # a session's turns, in order
                    res = await client.send(req)
                    res.start_s -= t0
                    results.append(res)
                    finished.add(id(req))
                    bar.update(1)

        return [asyncio.create_task(run_unit(i, u)) for i, u in enumerate(work)]

    tasks = [t for reqs, load in streams for t in stream_tasks(reqs, load)]
    try:
        _, pending = await asyncio.wait(tasks, timeout=timeout_s) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in tasks:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]  # a harness bug, not a failure
    finally:
        bar.close()
    duration = time.perf_counter() - t0
    for req in (r for r in requests if id(r) not in finished):
        results.append(RequestResult(ok=False, prompt_len=req.prompt_len, tag=req.tag,
                                     error="phase deadline: no answer in time"))
    label = " + ".join(load.label for _, load in streams)
    return Phase(name, label, results, summarize(results, duration, slo),
                 by_tag(results, duration, slo), dict(params or {}), config)

