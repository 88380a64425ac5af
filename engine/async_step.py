"""Async scheduling (vLLM's `--async-scheduling`): the host schedules and lays out step
n+1 while the device runs step n.

    call k:  schedule k+1 | forward k+1 (inputs read k's ids on the device)
             | sample k+1 | resolve k

A launched step's sampling requests each hold a placeholder (`Request.
num_output_placeholders`) for the token being sampled; the scheduler counts it as a
token to compute, so the next step computes it, its input id copied on the device from
the step in flight (`fill_placeholders`). The host reads step k's tokens after step k+1
is queued (`resolve`), then checks stops as the synchronous loop does: a request that
ends there was already scheduled once more, and that extra token is dropped. A request
whose placeholder is its max_tokens'th token is not scheduled again.

What the next step needs of step k's tokens it finds on the device or waits for:

- penalties (presence/frequency/repetition): the sampler's token history takes a row's
  placeholder token from step k's ids on the device (`sampler.PendingIds`), so step k+1
  penalises exactly what the synchronous loop would.
- structured outputs: the grammar's mask for step k+1 needs step k's token on the host.
  As vLLM's async scheduler does (`pending_structured_output_tokens`), the whole step's
  forward pass is queued first, then the host reads step k's tokens (advancing the
  matchers) and only then samples step k+1: the forward overlaps, the sampling waits.
  Steps whose structured requests have no token in flight (their first sample) do
  not wait.
- parallel samples (n / best_of): the first sample's row draws every fork's first
  token; the forks start (fork onto the prompt's KV) when the host reads that step,
  one step later than synchronous scheduling, and run as ordinary requests from there.
- prefill producers (`hold_kv`): every step reports their KV progress, so a step with
  one is read right after its launch, before the next step is scheduled.

(The engine has no speculative decoding, whose draft tokens would be placeholders too.)
Block ids handed to writers off the compute stream (a remote prefill's KV, offload-tier
loads) wait for the step in flight first: a request that ended while it ran freed
blocks that step still writes.

The placeholder ids are written into the step's device input buffer before anything
reads it: a decode step replayed from a CUDA graph finds them in the graph's buffer,
and under tensor parallelism rank 0's broadcast of that buffer carries them to the
other ranks (only rank 0 samples).

On CPU torch runs each step before `forward` returns: the order of work is the same,
with no overlap. On CUDA the device runs step k while the host builds step k+1.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.input_batch import BatchRows
from engine.outputs import SampledTokens
from engine.request import Request, RequestStatus
from engine.sampler import DeviceTokens, Logprobs, PendingIds
from engine.scheduler import SchedulerOutput
from engine.step_inputs import StepInputs

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput

Sampled = tuple[int, Logprobs | None]


class StepTokens:
    """A launched step's sampled tokens. `sampling`: its scheduled requests that sample
    (their chunk reaches their newest token); `rows`: the request of each sampled row
    (a sampling request, then its forks); `device`: the ids, on the device; `batch`:
    the persistent batch's slots of the sampling rows (engine/input_batch.py), told
    of the tokens when the host reads them. Their copy to the host starts here,
    queued after the step's work (even with no rows: waiting for it is waiting for
    the step)."""

    def __init__(self, sampling: Sequence[Request], rows: Sequence[Request],
                 device: DeviceTokens, batch: BatchRows) -> None:
        self.sampling = list(sampling)
        self.rows = self.sampling if rows is sampling else list(rows)
        self.device = device
        self.batch = batch
        self._result: SampledTokens | None = None
        batch.batch.sampled(batch)
        device.to_host()

    @functools.cached_property
    def pending(self) -> PendingIds:
        """The ids as the next step reads them (async scheduling only)."""
        return PendingIds(self.device.ids, {r.request_id: i for i, r in enumerate(self.rows)})

    def result(self) -> SampledTokens:
        """{request_id: (token, logprobs)}; waits for the copy to the host."""
        if self._result is None:
            tokens, lps = self.device.result()
            b = self.batch
            b.batch.appended(b, self.device.host_ids()[b.index])
            aligned = len(self.rows) == len(self.sampling)  # (forks add rows)
            self._result = SampledTokens(self.rows, tokens, lps, aligned)
        return self._result


def fill_placeholders(step: StepInputs, prev: StepTokens | None) -> None:
    """Writes into `step.input_ids`, on the device, the ids `prev` sampled for the
    step's tokens in flight (`step.in_flight`)."""
    if step.in_flight is None:
        return
    if prev is None:
        raise RuntimeError("a step has placeholder tokens but no step in flight")
    at, src = _in_flight_rows(step.in_flight, prev.batch)
    n = len(at)
    if at[-1] == n - 1 and src[-1] == n - 1 and (src == at).all():
        # (a decode step after a decode step of the same requests: rows 0..n-1)
        step.input_ids[:n].copy_(prev.device.ids[:n])
        return
    idx = torch.from_numpy(np.stack([at, src]))
    dev = step.input_ids.device
    if dev.type == "cuda":  # pinned and non-blocking: a pageable copy waits for the device
        idx = idx.pin_memory().to(dev, non_blocking=True)
    step.input_ids[idx[0]] = prev.device.ids[idx[1]].to(step.input_ids.dtype)


def _in_flight_rows(in_flight: tuple[np.ndarray, np.ndarray, np.ndarray],
                    prev: BatchRows) -> tuple[np.ndarray, np.ndarray]:
    """(indices in input_ids, rows of the step in flight) of a planned step's tokens
    in flight: each slot's row in `prev`, matched by slot and generation."""
    at, slots, gens = in_flight
    if len(slots) == len(prev.slots) and (slots == prev.slots).all():
        row = prev.index  # the same requests in the same order (most decode steps)
        ok = (gens == prev.gens).all()
    else:
        size = max(prev.batch.capacity, int(slots.max()) + 1)
        row_of = np.zeros(size, np.int64)
        gen_of = np.zeros(size, np.int64)  # (generations start at 1: 0 matches none)
        row_of[prev.slots], gen_of[prev.slots] = prev.index, prev.gens
        row, ok = row_of[slots], (gen_of[slots] == gens).all()
    if not ok:
        raise RuntimeError("a step has a token in flight that no step in flight samples")
    return at, row


@dataclass(slots=True)
class StepLogits:
    """A forwarded step's logits [S, V] on the device, row i for `sample_reqs[i]`."""

    sample_reqs: list[Request]
    logits: torch.Tensor
    rows: BatchRows  # their slots in the persistent batch


def waits_for_tokens(step: StepLogits) -> bool:
    """Whether sampling `step` needs the tokens of the step in flight on the host
    first: a structured request's mask depends on its placeholder token."""
    return any(r.grammar is not None and r.num_output_placeholders for r in step.sample_reqs)


@dataclass(slots=True)
class _Launched:
    out: SchedulerOutput
    ends: list[int]  # each scheduled request's computed tokens once the step is done
    tokens: StepTokens
    done: torch.cuda.Event | None  # after the step's work on the compute stream (CUDA)
    producers: bool  # it has prefill producers (hold_kv)


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
        prev, self.in_flight = self.in_flight, None
        outputs: list[RequestOutput] = []
        launched = None
        if out.scheduled:
            logits, ends = self._forward(out, prev)
            if prev is not None and waits_for_tokens(logits):
                outputs += self._resolve(prev)  # the grammars take step k's tokens
                prev = None
            launched = self._sample(out, ends, logits, prev)
        if prev is not None:
            outputs += self._resolve(prev)
        elif launched is None and e.offload is not None:
            e.offload.reap(e.kv.pool, timeout=0.01)  # idle but copies pending: don't spin
        if launched is not None and launched.producers:
            outputs += self._resolve(launched)  # producers report every step's progress
            launched = None
        self.in_flight = launched
        return outputs

    def wait(self) -> None:
        """Blocks until the step in flight, if any, is done on the device."""
        if self.in_flight is not None and self.in_flight.done is not None:
            self.in_flight.done.synchronize()

    def _forward(self, out: SchedulerOutput, prev: _Launched | None,
                 ) -> tuple[StepLogits, list[int]]:
        """Queues `out`'s forward pass (its placeholder inputs read from `prev`'s ids on
        the device); advances its requests' computed tokens. Returns its logits and each
        scheduled request's computed tokens once it is done."""
        e = self.engine
        if e.offload is not None and e.offload.loads and prev is not None \
                and prev.done is not None:
            prev.done.synchronize()  # the tiers write blocks off the compute stream
        e._run_loads(out)
        logits = e.runner.forward(out, e.kv, prev.tokens if prev is not None else None)
        ends = []
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            ends.append(s.request.num_computed_tokens)
        return logits, ends

    def _sample(self, out: SchedulerOutput, ends: list[int], logits: StepLogits,
                prev: _Launched | None) -> _Launched:
        e = self.engine
        tokens = e.runner.sample(logits, prev.tokens if prev is not None else None)
        for r in tokens.sampling:
            r.num_output_placeholders += 1
        return _Launched(out, ends, tokens, e.runner.record_kv_ready(),
                         e.runner.step_holds_kv)

    def _resolve(self, step: _Launched) -> list[RequestOutput]:
        """Takes `step`'s tokens: caches its full blocks, appends tokens, checks stops
        (LLMEngine._step_outputs). Requests that ended meanwhile drop theirs."""
        e = self.engine
        sched = e.scheduler
        sampled = step.tokens.result()
        scheduled = step.out.scheduled
        # (a sampling request's row holds its own token: forks have rows of their own)
        tokens, lps = sampled.along(scheduled)
        live = []
        got_token = []
        for s, end, tok, lp in zip(scheduled, step.ends, tokens, lps, strict=True):
            req = s.request
            if tok is not None:
                req.num_output_placeholders -= 1
            if sched.requests.get(req.request_id) is not req:
                continue  # finished or aborted while the step ran
            live.append(s)
            if req.status == RequestStatus.RUNNING:  # (not preempted meanwhile)
                e.kv.cache_blocks(req, end)
            if tok is not None:
                req.append_token(tok, lp)
                got_token.append(req)
        sched.fair.charge_outputs(got_token)
        return e._step_outputs(SchedulerOutput(live), sampled, got_token, step.done,
                               step.producers)
