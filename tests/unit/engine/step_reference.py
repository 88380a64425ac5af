"""The reference a built step must equal: one step laid out in plain Python from the
scheduled requests themselves (their token lists, computed counts and the KV cache
manager's block tables), with the layout and padding rules engine/step_inputs.py's
docstring draws; and `step_on`, which plans and builds a step the way the model runner
does (persistent batch, then `StepInputBuilder.build_planned`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.input_batch import InputBatch
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.request import Request
from engine.scheduler import ScheduledRequest
from engine.step_inputs import StepInputBuilder, StepInputs


@dataclass
class Layout:
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]
    max_query_len: int
    max_seq_len: int
    sample_reqs: list[Request]
    in_flight: list[tuple[int, Request]]  # (index in input_ids, request)


def reference_layout(scheduled: Sequence[ScheduledRequest], kv: KVCacheManager,
                     block_size: int, pad: tuple[int, int, int] | None = None,
                     width: int | None = None) -> Layout:
    """The step for `scheduled`, padded to `pad` (tokens, sequences, sampled rows) and
    its block tables `width` wide (else as wide as the longest sequence needs)."""
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    samples: list[int] = []
    sample_reqs: list[Request] = []
    in_flight: list[tuple[int, Request]] = []
    for s in scheduled:
        r = s.request
        lo, hi = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
        known = r.all_token_ids
        table = kv.block_ids(r.request_id)
        for p in range(lo, hi):
            if p < len(known):
                ids.append(known[p])
            else:  # a token the step in flight is sampling: filled in on the device
                in_flight.append((len(ids), r))
                ids.append(0)
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        qsl.append(len(ids))
        seq_lens.append(hi)
        tables.append(table[:cdiv(hi, bs)])
        if hi == len(known) + r.num_output_placeholders:  # its chunk reaches its end
            samples.append(qsl[-1] - 1)
            sample_reqs.append(r)
    t_real, n_real = len(ids), len(scheduled)
    w = width or max(1, max(len(row) for row in tables))
    t, b, s_ = pad or (t_real, n_real, len(samples))
    # | real tokens | padding tokens: id 0, position 0, slot -1 |
    ids += [0] * (t - t_real)
    pos += [0] * (t - t_real)
    slots += [-1] * (t - t_real)
    # | real sequences | padding sequences: seq_len 0, one token each, the last the rest |
    qsl += [min(t_real + k, t) for k in range(1, b - n_real)] + [t] * (b > n_real)
    seq_lens += [0] * (b - n_real)
    tables = [row + [0] * (w - len(row)) for row in tables] + [[0] * w] * (b - n_real)
    # | real sampled rows | padding rows: row 0 |
    samples += [0] * (s_ - len(samples))
    return Layout(ids, pos, slots, qsl, seq_lens, tables, samples,
                  max(s.num_new_tokens for s in scheduled), max(seq_lens), sample_reqs,
                  in_flight)


def layout_of(step: StepInputs) -> Layout:
    """What a built step holds, in `Layout`'s terms (its tokens in flight found through
    the batch rows it was planned from); its host-side lists must agree with its
    buffer."""
    meta = step.meta
    assert meta.query_start_loc_cpu == meta.query_start_loc.tolist()
    assert meta.seq_lens_cpu == meta.seq_lens.tolist()
    assert meta.num_tokens == len(step.input_ids) and meta.num_seqs == len(meta.seq_lens)
    in_flight: list[tuple[int, Request]] = []
    if step.in_flight is not None:
        at, slots, gens = step.in_flight
        assert step.rows is not None
        batch = step.rows.batch
        assert (batch.gen[slots] == gens).all()
        in_flight = list(zip(at.tolist(), batch.reqs[slots].tolist(), strict=True))
    return Layout(step.input_ids.tolist(), step.positions.tolist(),
                  meta.slot_mapping.tolist(), meta.query_start_loc.tolist(),
                  meta.seq_lens.tolist(), meta.block_tables.tolist(),
                  step.sample_rows.tolist(), meta.max_query_len, meta.max_seq_len,
                  list(step.sample_reqs), in_flight)


def step_on(builder: StepInputBuilder, batch: InputBatch, kv: KVCacheManager,
            scheduled: Sequence[ScheduledRequest], pad: tuple[int, int, int] | None = None,
            width: int | None = None, out: torch.Tensor | None = None) -> StepInputs:
    """Plans `scheduled` on the persistent `batch` and builds it, as the model runner
    does; the batch's computed tokens advance by the step's."""
    return builder.build_planned(batch.plan(scheduled, kv), batch, pad, width, out)


def sampled(step: StepInputs, scheduled: Sequence[ScheduledRequest],
            tokens: Sequence[int]) -> None:
    """The rest of the step, as the scheduler and the runner see it: each request's
    computed tokens advance by the step's, the sampling requests append `tokens` (one
    each, in sampled-row order) and the batch is told of them."""
    assert step.rows is not None
    for s in scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
    for r, tok in zip(step.sample_reqs, tokens, strict=True):
        r.append_token(tok)
    step.rows.batch.sampled(step.rows)
    step.rows.batch.appended(step.rows, np.array(tokens, np.int64))
