"""Load shapes: when each unit of work starts.

A unit is one request, or one multi-turn session (its turns run back to back). Open
loop: `constant` (fixed gaps 1/rate), `poisson` (exponential gaps, mean 1/rate) and
`trace` (the requests' own `arrival_s`) give start offsets; closed loop:
`concurrency` keeps N units in flight. `max_concurrency` caps in-flight units in the
open-loop modes too (0: no cap), as `vllm bench serve --max-concurrency` does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.base import BenchError, BenchRequest

KINDS = ("constant", "poisson", "concurrency", "trace")


@dataclass(frozen=True, slots=True)
class LoadSpec:
    kind: str = "concurrency"
    rate: float = 0.0  # units/s for constant and poisson
    concurrency: int = 1  # in-flight units for concurrency
    max_concurrency: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BenchError(f"load kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind in ("constant", "poisson") and not self.rate > 0:
            raise BenchError(f"{self.kind} load needs a rate > 0 req/s")
        if self.kind == "concurrency" and self.concurrency < 1:
            raise BenchError("concurrency must be >= 1")
        if self.max_concurrency < 0:
            raise BenchError("max_concurrency must be >= 0")

    @property
    def label(self) -> str:
        if self.kind == "concurrency":
            return f"concurrency {self.concurrency}"
        if self.kind == "trace":
            return "trace timestamps"
        return f"{self.kind} {self.rate:g} req/s"


def units(requests: list[BenchRequest]) -> list[list[BenchRequest]]:
    """Groups a session's turns (in turn order) into one unit; other requests are units
    of one. Units keep the order of their first request."""
    out: list[list[BenchRequest]] = []
    by_session: dict[str, list[BenchRequest]] = {}
    for r in requests:
        if r.session is None:
            out.append([r])
        elif r.session in by_session:
            by_session[r.session].append(r)
        else:
            by_session[r.session] = [r]
            out.append(by_session[r.session])
    for u in out:
        u.sort(key=lambda r: r.turn)
    return out


def start_offsets(spec: LoadSpec, work: list[list[BenchRequest]]) -> list[float] | None:
    """Seconds from the phase start at which each unit starts; None for closed loop."""
    if spec.kind == "concurrency":
        return None
    if spec.kind == "trace":
        times = [u[0].arrival_s for u in work]
        if any(t is None for t in times):
            raise BenchError("trace load needs requests with timestamps (a trace dataset)")
        return [float(t or 0.0) for t in times]
    if spec.kind == "constant":
        return [i / spec.rate for i in range(len(work))]
    rng = random.Random(spec.seed)
    t, out = 0.0, []
    for _ in work:
        out.append(t)
        t += rng.expovariate(spec.rate)
    return out
