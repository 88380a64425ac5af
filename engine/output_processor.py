"""Requests to RequestOutputs, as vLLM v1's OutputProcessor: incremental
detokenization, the stop checks (EOS, stop ids and strings, the grammar, length) and
parallel samples (n / best_of, engine/parallel.py), whose outputs are held or merged
per group."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestOutput
from engine.parallel import SampleGroup
from engine.request import Request, RequestStatus
from engine.sampling_params import RequestOutputKind
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_DELTA, _FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY  # (per request)


@dataclass(slots=True)
class _Track:
    detok: IncrementalDetokenizer
    sent_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int,
                 block_ids: Callable[[str], list[int]]) -> None:
        """`block_ids`: a request's KV block ids (reported for producers, hold_kv)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.block_ids = block_ids
        self._tracks: dict[str, _Track] = {}
        self.groups: dict[str, SampleGroup] = {}  # n / best_of requests, by every member id

    def add(self, req: Request) -> None:
        """Starts following `req` and, for n / best_of > 1, the samples in its group
        (they wait in `req.forks`)."""
        self._track(req)
        if req.sampling_params.num_samples == 1:
            return
        group = SampleGroup.of(req)
        for m in group.members:
            self.groups[m.request_id] = group
            if m is not req:
                self._track(m)

    def _track(self, req: Request) -> None:
        p = req.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids[-6:], p.stop,
                                       p.skip_special_tokens, p.include_stop_str_in_output)
        detok.skip(req.output_token_ids)  # resumed tokens: already shown by another worker
        self._tracks[req.request_id] = _Track(detok, sent_tokens=req.num_output_tokens)

    def check_stop(self, req: Request) -> RequestStatus | None:
        """Takes `req`'s newest token; the status it ends the request with, if any."""
        self.detokenize([req])
        return self.stop_status(req)

    def detokenize(self, reqs: Sequence[Request]) -> None:
        """Takes each request's newest token into its text (one tokenizer call for them
        all); `stop_status` then says whether it ends the request."""
        IncrementalDetokenizer.add_newest([self._tracks[r.request_id].detok for r in reqs],
                                          [r.output_token_ids[-1] for r in reqs])

    def stop_status(self, req: Request) -> RequestStatus | None:
        """The status `req` ends with after its newest token (`detokenize`d), if any."""
        track = self._tracks[req.request_id]
        tok = req.output_token_ids[-1]
        if track.detok.stopped:
            req.stop_reason = track.detok.stop_str
            return RequestStatus.FINISHED_STOPPED
        p = req.sampling_params
        if tok in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if tok in p.stop_token_ids:
            req.stop_reason = tok
            return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None:  # the matcher takes the new tokens; complete: stop
            if not req.grammar.advance(req.output_token_ids):
                log.warning("request %s: token %s is outside its grammar; ending it",
                            req.request_id, req.grammar.rejected)
                return RequestStatus.FINISHED_ERROR
            if req.grammar.terminated:
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def emit(self, req: Request, final: bool) -> list[RequestOutput]:
        """`req`'s output to deliver (none, or several, for a sample group's member)."""
        if not final and not req.hold_kv \
                and req.sampling_params.output_kind is _FINAL_ONLY:
            return []  # the final output's delta is then everything
        group = self.groups.get(req.request_id)
        if group is None:
            return [self.finish(req) if final else self._output(req, final=False)]
        if not final and group.hold:
            return []  # text and tokens accumulate until the ranking
        outs = group.add(self.finish(req) if final else self._output(req, False))
        if final:
            del self.groups[req.request_id]
        return outs

    def finish(self, req: Request) -> RequestOutput:
        """`req`'s last output; it is followed no more."""
        out = self._output(req, final=True)
        del self._tracks[req.request_id]
        if req.grammar is not None and req.grammar.rejected is not None:
            out.error = f"token {req.grammar.rejected} is outside the request's grammar"
        return out

    def _output(self, req: Request, final: bool) -> RequestOutput:
        """What `req` has produced since its last output (and all of it, as its
        `output_kind` asks): copies of the whole output only for CUMULATIVE."""
        track = self._tracks[req.request_id]
        new_ids = req.output_token_ids[track.sent_tokens:]
        track.sent_tokens = req.num_output_tokens
        new_text = track.detok.take_delta(final)
        p = req.sampling_params
        logprobs = None
        if p.output_kind is _DELTA:
            token_ids, text = new_ids, new_text
            if p.logprobs is not None:  # the newest ones (resumed tokens have none)
                logprobs = req.logprobs[max(0, len(req.logprobs) - len(new_ids)):]
        else:
            token_ids, text = list(req.output_token_ids), track.detok.text
            if p.logprobs is not None:
                logprobs = list(req.logprobs)
        out = RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=token_ids, text=text, new_token_ids=new_ids, new_text=new_text,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
            first_token_time=req.first_token_time, scheduled_time=req.scheduled_time,
            logprobs=logprobs, index=req.index, cumulative_logprob=req.cumulative_logprob,
            num_computed_tokens=req.num_computed_tokens)
        # The rest only where set: a keyword costs as much as a field (every step, each
        # request).
        if final:
            out.finished, out.finish_reason = True, req.status.value
            out.stop_reason = req.stop_reason
        if p.prompt_logprobs is not None:
            out.prompt_logprobs = req.prompt_logprobs
        if req.hold_kv:
            out.block_ids = self.block_ids(req.request_id)
        return out
