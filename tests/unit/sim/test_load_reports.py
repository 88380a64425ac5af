"""The simulated gateway sees a worker's load when the worker's real Load stream would
report it (worker/service.py `WorkerService.Load`): the same requests starting at the
same times, the real loop on asyncio's clock, the simulator's on its own. A request
that starts or ends wakes the loop, which reports I/4 later, or at its tick when it was
already sleeping towards one; starts close together go out in one report."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from engine.request import RequestStatus
from protos import splitserve_pb2 as pb
from sim.cluster import Simulator
from sim.config import ClusterConfig
from sim.profile import load_profile
from sim.request import make_request
from worker.config import WorkerConfig
from worker.metrics import WorkerMetrics
from worker.service import WorkerService

INTERVAL_S = 0.8  # I: a report I/4 = 0.2 s after a start, ticks every 1.0 s
# Request starts, seconds after the stream's first report (at 0): woken while waiting
# (0.05 -> 0.25); twice while woken (0.60, 0.65 -> 0.80, one report); while sleeping
# towards the tick at 1.80 (1.70 -> 1.80, not 1.90); waiting again (2.30 -> 2.50).
# Each start is 0.1 s or more from the edges of the loop's phase it falls in.
STARTS = (0.05, 0.60, 0.65, 1.70, 2.30)
EXPECTED = ((0.25, 1), (0.80, 3), (1.80, 4), (2.50, 5))  # (report time, requests seen)
SLACK_S = 0.05  # asyncio's timers on a busy machine; the cases differ by >= 0.1 s


async def _real_reports() -> list[tuple[float, int]]:
    """(time, requests waiting) of each report the real Load stream sends with new figures."""
    cfg = WorkerConfig(role="colocated", worker_id="w0", load_interval_ms=int(INTERVAL_S * 1e3),
                       load_keepalive_s=60.0)
    service = WorkerService(cfg, WorkerMetrics("m", lambda: None), "layout")
    started = 0  # the engine's figures: the requests started so far wait in it
    idle = dict(num_running=0, kv_usage=0.0, num_free_blocks=8, num_blocks=8,
                prefix_cache_queries=0, prefix_cache_hits=0)
    llm: Any = SimpleNamespace(stats=lambda: SimpleNamespace(**idle, num_waiting=started),
                               num_active=0)
    service.attach(llm)
    seen: list[tuple[float, int]] = []
    stream = service.Load(pb.LoadRequest(), None)  # type: ignore[arg-type]
    first = await stream.__anext__()
    t0 = time.monotonic()
    assert first.num_waiting == 0

    async def starts() -> None:
        nonlocal started
        for at in STARTS:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            started += 1  # a Generate starts: the engine holds one more request...
            service.changed.set()  # ...and the stream is poked, as Generate does

    async def read() -> None:
        async for rep in stream:
            seen.append((time.monotonic() - t0, rep.num_waiting))
            if rep.num_waiting == len(STARTS):
                return

    task = asyncio.create_task(starts())
    await asyncio.wait_for(read(), timeout=10.0)
    await task
    service.stopping = True
    await stream.aclose()
    return seen


def _simulated_reports() -> list[tuple[float, int]]:
    """(time, requests waiting) at which the simulated gateway's view of the worker
    changes, read every millisecond, for the same starts."""
    sim = Simulator(ClusterConfig(colocated=1, report_interval_s=INTERVAL_S),
                    load_profile("cpu"))
    w = sim.workers["colocated-0"]
    seen: list[tuple[float, int]] = []
    pending = list(STARTS)
    shown = 0
    for ms in range(1, 2700):
        sim.now = ms / 1e3
        while pending and pending[0] <= sim.now:
            sim.now = pending.pop(0)
            sim.gateway.changed(w)  # as Simulator._on_decode: the start pokes the loop
            w.scheduler.add_request(make_request(f"r{len(STARTS) - len(pending)}", 32, [],
                                                 sim.now))
            sim.now = ms / 1e3
        n = int(sim.gateway.candidates().num_waiting[0])
        if n != shown:
            seen.append((sim.now, n))
            shown = n
    return seen


def _check(seen: list[tuple[float, int]], slack: float) -> None:
    assert [n for _, n in seen] == [n for _, n in EXPECTED], seen
    for (t, _), (want, _) in zip(seen, EXPECTED, strict=True):
        assert abs(t - want) <= slack, f"reported at {t:.3f} s, expected {want:.3f} s: {seen}"


def test_the_simulated_gateway_sees_load_when_the_real_stream_reports_it() -> None:
    _check(_simulated_reports(), 0.0015)  # the model, to its millisecond grid
    _check(asyncio.run(_real_reports()), SLACK_S)  # the production loop, on its clock


def test_reports_read_every_worker_at_once_without_an_interval() -> None:
    sim = Simulator(ClusterConfig(colocated=2, report_interval_s=0.0), load_profile("cpu"))
    w = sim.workers["colocated-1"]
    sim.now = 0.5
    w.scheduler.add_request(make_request("r0", 32, [], sim.now))
    assert sim.gateway.candidates().num_waiting.tolist() == [0, 1]


@pytest.mark.parametrize("interval", [0.1, 0.4])
def test_a_request_that_ended_counts_on_its_worker_until_the_report_after_it(
        interval: float) -> None:
    """The stale view the real gateway routes on (worker/service.py): a request that
    ended I/4 ago or less still counts on its worker; by the report, it does not."""
    sim = Simulator(ClusterConfig(colocated=1, report_interval_s=interval),
                    load_profile("cpu"))
    w = sim.workers["colocated-0"]
    sim.now = 1.0
    sim.gateway.changed(w)
    w.scheduler.add_request(make_request("r0", 32, [], sim.now))
    sim.now = 2.0
    assert sim.gateway.candidates().num_waiting[0] == 1
    sim.gateway.changed(w)  # it ends
    w.scheduler.finish("r0", RequestStatus.FINISHED_ABORTED)
    sim.now = 2.0 + interval / 4 - 1e-6
    assert sim.gateway.candidates().num_waiting[0] == 1
    sim.now = 2.0 + interval / 4
    assert sim.gateway.candidates().num_waiting[0] == 0
