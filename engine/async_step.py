"""Async scheduling (vLLM's `--async-scheduling`): the host schedules and lays out step
n+1 while the device runs step n.

    call k:  schedule k+1 | launch k+1 (inputs read k's ids on the device) | resolve k

A launched step's sampling requests each hold a placeholder (`Request.
num_output_placeholders`) for the token being sampled; the scheduler counts it as a
token to compute, so the next step computes it, its input id copied on the device from
the step in flight (`fill_placeholders`). The host reads step k's tokens after step k+1
is queued (`resolve`), then checks stops as the synchronous loop does: a request that
ends there was already scheduled once more, and that extra token is dropped. A request
whose placeholder is its max_tokens'th token is not scheduled again.

A step falls back to synchronous scheduling (it is resolved right after its launch, before
the next step is scheduled) when the next step needs the host to have seen its tokens:
structured outputs (the grammar's mask), presence/frequency/repetition penalties (the
token history), parallel samples (n / best_of: the forks start from the first token),
and prefill producers (`hold_kv`: every step reports their KV progress). (The engine
has no speculative decoding, whose draft tokens would be placeholders too.) Block ids
handed to writers off the compute stream (a remote prefill's KV, offload-tier loads)
wait for the step in flight first: a request that ended while it ran freed blocks that
step still writes.

The placeholder ids are written into the step's device input buffer before anything
reads it: a decode step replayed from a CUDA graph finds them in the graph's buffer,
and under tensor parallelism rank 0's broadcast of that buffer carries them to the
other ranks (only rank 0 samples).

On CPU torch runs each step before `launch` returns: the order of work is the same,
with no overlap. On CUDA the device runs step k while the host builds step k+1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.request import Request, RequestStatus
from engine.sampler import DeviceTokens, Logprobs, has_penalty
from engine.scheduler import SchedulerOutput
from engine.step_inputs import StepInputs

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput

Sampled = tuple[int, Logprobs | None]


class StepTokens:
    """A launched step's sampled tokens. `sampling`: its scheduled requests that sample
    (their chunk reaches their newest token); `rows`: the request of each sampled row
    (a sampling request, then its forks); `device`: the ids, on the device. Their copy
    to the host starts here, queued after the step's work (even with no rows: waiting
    for it is waiting for the step)."""

    def __init__(self, sampling: Sequence[Request], rows: Sequence[Request],
                 device: DeviceTokens) -> None:
        self.sampling = list(sampling)
        self.rows = list(rows)
        self.device = device
        device.to_host()

    def result(self) -> dict[str, Sampled]:
        """{request_id: (token, logprobs)}; waits for the copy to the host."""
        tokens, lps = self.device.result()
        return {r.request_id: (t, lp) for r, t, lp in zip(self.rows, tokens, lps, strict=True)}


def fill_placeholders(step: StepInputs, prev: StepTokens | None) -> None:
    """Writes into `step.input_ids`, on the device, the ids `prev` sampled for the
    step's placeholder tokens."""
    if not step.placeholders:
        return
    if prev is None:
        raise RuntimeError("a step has placeholder tokens but no step in flight")
    row = {r.request_id: i for i, r in enumerate(prev.rows)}
    idx = torch.tensor([[i for i, _ in step.placeholders],
                        [row[r.request_id] for _, r in step.placeholders]])
    dev = step.input_ids.device
    if dev.type == "cuda":  # pinned and non-blocking: a pageable copy waits for the device
        idx = idx.pin_memory().to(dev, non_blocking=True)
    step.input_ids[idx[0]] = prev.device.ids[idx[1]].to(step.input_ids.dtype)


def needs_host(out: SchedulerOutput, tokens: StepTokens) -> bool:
    """Whether the step after this one needs its tokens on the host first (the module
    docstring lists why)."""
    return any(s.request.hold_kv for s in out.scheduled) or any(
        r.grammar is not None or r.forks or has_penalty(r.sampling_params)
        for r in tokens.sampling)


@dataclass(slots=True)
class _Launched:
    out: SchedulerOutput
    ends: list[int]  # each scheduled request's computed tokens once the step is done
    tokens: StepTokens
    done: torch.cuda.Event | None  # after the step's work on the compute stream (CUDA)


class AsyncSteps:
    """The engine loop under async scheduling: `LLMEngine.step` calls `step`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.in_flight: _Launched | None = None

    def step(self) -> list[RequestOutput]:
        e = self.engine
        if e.offload is not None:
            e.offload.save_new(e.kv.pool, e.runner.kv_cache)
            e.offload.reap(e.kv.pool)
        out = e.scheduler.schedule()
        e.last_step_tokens = out.num_tokens
        launched = self._launch(out) if out.scheduled else None
        outputs: list[RequestOutput] = []
        if self.in_flight is not None:
            outputs += self._resolve(self.in_flight)
        elif launched is None and e.offload is not None:
            e.offload.reap(e.kv.pool, timeout=0.01)  # idle but copies pending: don't spin
        self.in_flight = launched
        if launched is not None and needs_host(launched.out, launched.tokens):
            outputs += self._resolve(launched)  # synchronous: the next step needs them
            self.in_flight = None
        return outputs

    def wait(self) -> None:
        """Blocks until the step in flight, if any, is done on the device."""
        if self.in_flight is not None and self.in_flight.done is not None:
            self.in_flight.done.synchronize()

    def _launch(self, out: SchedulerOutput) -> _Launched:
        e = self.engine
        if e.offload is not None and e.offload.loads:
            self.wait()  # the tiers write blocks off the compute stream
        e._run_loads(out)
        prev = self.in_flight.tokens if self.in_flight is not None else None
        tokens = e.runner.launch(out, e.kv, prev)
        ends = []
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            ends.append(s.request.num_computed_tokens)
        for r in tokens.sampling:
            r.num_output_placeholders += 1
        return _Launched(out, ends, tokens, e.runner.record_kv_ready())

    def _resolve(self, step: _Launched) -> list[RequestOutput]:
        """Takes `step`'s tokens: caches its full blocks, appends tokens, checks stops
        (LLMEngine._step_outputs). Requests that ended meanwhile drop theirs."""
        e = self.engine
        sched = e.scheduler
        sampled = step.tokens.result()
        sampling = {r.request_id for r in step.tokens.sampling}
        live = []
        got_token = []
        for s, end in zip(step.out.scheduled, step.ends, strict=True):
            req = s.request
            if req.request_id in sampling:
                req.num_output_placeholders -= 1
            if sched.requests.get(req.request_id) is not req:
                continue  # finished or aborted while the step ran
            live.append(s)
            if req.status == RequestStatus.RUNNING:  # (not preempted meanwhile)
                e.kv.cache_blocks(req, end)
            got = sampled.get(req.request_id)
            if got is not None:
                req.append_token(got[0], got[1])
                sched.fair.charge_output(req)
                got_token.append(req)
        return e._step_outputs(SchedulerOutput(live), sampled, got_token, step.done)
