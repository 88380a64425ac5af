"""Requests to RequestOutputs, as vLLM v1's OutputProcessor: incremental
detokenization, the stop checks (EOS, stop ids and strings, the grammar, length) and
parallel samples (n / best_of, engine/parallel.py), whose outputs are held or merged
per group.

A decode step's work per request is one pass (`take_tokens`): its newest token into
its text, its stop checks, and an output only if it emits one this step (FINAL_ONLY
requests emit at their end). What a request's checks need is fixed when it is added
(`_Track`), so a step reads no sampling parameters."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.detokenizer import PROMPT_TAIL, IncrementalDetokenizer
from engine.outputs import RequestOutput
from engine.parallel import SampleGroup
from engine.request import Request, RequestStatus
from engine.sampling_params import RequestOutputKind
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_DELTA, _FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
_STOPPED, _LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


@dataclass(slots=True)
class _Track:
    """A followed request and what its steps need of it."""

    req: Request
    detok: IncrementalDetokenizer
    sent_tokens: int  # output tokens its outputs have carried
    stop_ids: frozenset[int]  # its EOS ids (unless ignore_eos) and stop_token_ids
    eos: int | None  # the tokenizer's EOS unless ignore_eos: it ends with no stop reason
    include_stop: bool  # a stop token's or string's text ends the output text
    max_output: int  # output tokens that end it: max_tokens, or what max_model_len leaves
    delta: bool  # DELTA outputs (else CUMULATIVE or FINAL_ONLY: everything so far)
    every_step: bool  # it has an output every step it gets a token, not only its last
    logprobs: bool
    prompt_logprobs: bool
    group: SampleGroup | None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int,
                 block_ids: Callable[[str], list[int]]) -> None:
        """`block_ids`: a request's KV block ids (reported for producers, hold_kv)."""
        self.tokenizer = tokenizer
        self._eos = tokenizer.eos_token_id
        self.max_model_len = max_model_len
        self.block_ids = block_ids
        self._tracks: dict[str, _Track] = {}
        self.groups: dict[str, SampleGroup] = {}  # n / best_of requests, by every member id

    def add(self, req: Request) -> None:
        """Starts following `req` and, for n / best_of > 1, the samples in its group
        (they wait in `req.forks`)."""
        if req.sampling_params.num_samples == 1:
            self._track(req, None)
            return
        group = SampleGroup.of(req)
        for m in group.members:
            self.groups[m.request_id] = group
            self._track(m, group)

    def _track(self, req: Request, group: SampleGroup | None) -> None:
        p = req.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids[-PROMPT_TAIL:],
                                       p.stop, p.skip_special_tokens,
                                       p.include_stop_str_in_output, p.min_tokens)
        detok.skip(req.output_token_ids)  # resumed tokens: already shown by another worker
        every_step = (p.output_kind is not _FINAL_ONLY or req.hold_kv) \
            and not (group is not None and group.hold)  # (held: until the ranking)
        self._tracks[req.request_id] = _Track(
            req, detok, req.num_output_tokens,
            frozenset(() if p.ignore_eos else req.eos_token_ids) | frozenset(p.stop_token_ids),
            None if p.ignore_eos else self._eos,
            p.include_stop_str_in_output,
            min(p.max_tokens, self.max_model_len - req.num_prompt_tokens),
            p.output_kind is _DELTA, every_step, p.logprobs is not None,
            p.prompt_logprobs is not None, group)

    def take_tokens(self, reqs: Sequence[Request],
                    ) -> tuple[list[RequestOutput], list[tuple[Request, RequestStatus]]]:
        """Takes each request's newest token (appended to it): its text, its stop
        checks, its output if it has one now. Returns the outputs and the requests the
        token ended, with their status (the caller finishes them in the scheduler;
        their final outputs are among the outputs already)."""
        outputs: list[RequestOutput] = []
        ended: list[tuple[Request, RequestStatus]] = []
        tracks = self._tracks
        for req in reqs:
            tr = tracks[req.request_id]
            status = self._check(tr)
            if status is not None:
                ended.append((req, status))
                outputs += self._emit(tr, status)
            elif tr.every_step:
                if tr.group is None:
                    outputs.append(self._output(tr, None))
                else:
                    outputs += tr.group.add(self._output(tr, None))
        return outputs, ended

    def check(self, req: Request) -> RequestStatus | None:
        """Takes `req`'s newest token into its text; the status it ends `req` with, if
        any (its output: `emit`)."""
        return self._check(self._tracks[req.request_id])

    def _check(self, tr: _Track) -> RequestStatus | None:
        req, detok = tr.req, tr.detok
        tok = req.output_token_ids[-1]
        if detok.stopped:  # by resumed tokens' text
            req.stop_reason = detok.stop_str
            return _STOPPED
        if tok in tr.stop_ids:  # its text is left out unless include_stop_str_in_output
            # The tokenizer's EOS gives no stop reason (vLLM's check_stop tests it first);
            # the generation config's other EOS ids are stop tokens to vLLM: their id.
            req.stop_reason = None if tok == tr.eos else tok
            if tr.include_stop:  # (as vLLM, a stop string in its text wins)
                detok.add_one(tok)
                if detok.stopped:
                    req.stop_reason = detok.stop_str
            return _STOPPED
        detok.add_one(tok)
        if detok.stopped:
            req.stop_reason = detok.stop_str
            return _STOPPED
        if req.grammar is not None:  # the matcher takes the new tokens; complete: stop
            if not req.grammar.advance(req.output_token_ids):
                log.warning("request %s: token %s is outside its grammar; ending it",
                            req.request_id, req.grammar.rejected)
                return RequestStatus.FINISHED_ERROR
            if req.grammar.terminated:
                return _STOPPED
        if len(req.output_token_ids) >= tr.max_output:
            return _LENGTH
        return None

    def emit(self, req: Request, final: bool) -> list[RequestOutput]:
        """`req`'s output to deliver outside `take_tokens` (after `check`, a producer's KV
        progress, the end of an aborted sample): none, or several for a sample group's
        member. Final: it ends with `req.status`."""
        tr = self._tracks[req.request_id]
        if final:
            return self._emit(tr, req.status)
        if not tr.every_step:
            return []
        out = self._output(tr, None)
        return [out] if tr.group is None else tr.group.add(out)

    def finish(self, req: Request) -> RequestOutput:
        """`req`'s last output, ended with `req.status`; it is followed no more."""
        return self._final(self._tracks[req.request_id], req.status)

    def _emit(self, tr: _Track, status: RequestStatus) -> list[RequestOutput]:
        out = self._final(tr, status)
        group = tr.group
        if group is None:
            return [out]
        del self.groups[tr.req.request_id]
        return group.add(out)

    def _final(self, tr: _Track, status: RequestStatus) -> RequestOutput:
        req = tr.req
        out = self._output(tr, status)
        del self._tracks[req.request_id]
        if req.grammar is not None and req.grammar.rejected is not None:
            out.error = f"token {req.grammar.rejected} is outside the request's grammar"
        return out

    def _output(self, tr: _Track, status: RequestStatus | None) -> RequestOutput:
        """What the request has produced since its last output, ending it with `status`
        if given (and all of it, as its output kind asks). A running request's
        non-DELTA output (CUMULATIVE, or FINAL_ONLY's progress for a hold_kv producer)
        copies the whole output; a final one holds the request's own lists (nothing is
        appended to them any more)."""
        req = tr.req
        ids = req.output_token_ids
        n = len(ids)
        final = status is not None
        new_ids = ids if final and tr.sent_tokens == 0 else ids[tr.sent_tokens:]
        tr.sent_tokens = n
        new_text = tr.detok.take_delta(final)
        logprobs = None
        if tr.delta:
            token_ids, text = new_ids, new_text
            if tr.logprobs:  # the newest ones (resumed tokens have none)
                lps = req.logprobs
                logprobs = lps[max(0, len(lps) - len(new_ids)):]
        else:
            token_ids, text = ids if final else list(ids), tr.detok.shown
            if tr.logprobs:
                logprobs = req.logprobs if final else list(req.logprobs)
        # Positional: keywords cost a decode step ~1 µs per request (outputs.py's order).
        out = RequestOutput(
            req.request_id, req.prompt_token_ids, token_ids, text, new_ids, new_text, n,
            final, status.value if status is not None else None,
            req.stop_reason if final else None,
            req.num_cached_tokens or 0, None, req.first_token_time, req.scheduled_time,
            logprobs, req.index, req.cumulative_logprob,
            req.prompt_logprobs if tr.prompt_logprobs else None, req.num_computed_tokens)
        if req.hold_kv:
            out.block_ids = self.block_ids(req.request_id)
        return out
