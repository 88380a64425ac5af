"""Incremental detokenization with stop strings, for streaming.

Decoding token by token breaks multi-byte characters and word-piece joins, so we keep
vLLM's two offsets: text up to `read_offset` has been emitted; decoding from
`prefix_offset` gives the context the next piece is joined to.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    With stop strings, text that could be the start of a stop string is held back
    until it is known not to be, so a stream never shows text past a stop.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_tail: Sequence[int],
                 stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 include_stop: bool = False) -> None:
        """`include_stop`: the text ends with the matched stop string (vLLM's
        include_stop_str_in_output); nothing is held back then, as in vLLM."""
        self._tok = tokenizer
        # A few prompt tokens give the first output token its joining context.
        self._ids: list[int] = list(prompt_tail)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = list(stop)
        self._hold = 0 if include_stop else max((len(s) for s in self._stop), default=1) - 1
        self._include = include_stop
        self._skip = skip_special_tokens
        self.text = ""  # full output text so far (the stop string cut unless included)
        self._emitted = 0  # chars of self.text already returned
        self.stopped = False
        self.stop_str: str | None = None  # the stop string that matched

    def add(self, token_ids: Sequence[int]) -> None:
        """Appends output tokens (none after a stop string has matched)."""
        for tid in token_ids:
            if self.stopped:
                break
            self._ids.append(tid)
            self._step()

    @staticmethod
    def add_newest(detoks: Sequence[IncrementalDetokenizer],
                   token_ids: Sequence[int]) -> None:
        """`detoks[i].add([token_ids[i]])` for every i, with one tokenizer call per
        skip_special_tokens value instead of two calls per detokenizer (a decode step:
        each request's one new token). They share one tokenizer."""
        live = []
        for d, t in zip(detoks, token_ids, strict=True):
            if not d.stopped:
                d._ids.append(t)
                live.append(d)
        if not live:
            return
        tok = live[0]._tok
        skips = {d._skip for d in live}
        for skip in skips:
            group = live if len(skips) == 1 else [d for d in live if d._skip == skip]
            # (see _pending) the joining context, mostly one id: a memory hit
            prefixes = tok.decode_batch([d._ids[d._prefix_offset:d._read_offset]
                                         for d in group], skip)
            fulls = tok.decode_batch([d._ids[d._prefix_offset:] for d in group], skip)
            for d, prefix, full in zip(group, prefixes, fulls, strict=True):
                d._apply(prefix, full)

    def skip(self, token_ids: Sequence[int]) -> None:
        """Adds tokens whose text an earlier stream of this request already showed
        (fail-over): the text holds them (stop strings see it whole), and what a stream
        would have returned by now is marked returned, so the next delta continues
        exactly where that stream left off."""
        self.add(token_ids)
        self.take_delta()

    def _step(self) -> None:
        prefix, full = self._pending()
        self._apply(self._tok.decode(prefix, self._skip), self._tok.decode(full, self._skip))

    def _pending(self) -> tuple[list[int], list[int]]:
        """The ids to decode for the newest token: (the joining context, it and the
        tokens after it)."""
        return (self._ids[self._prefix_offset:self._read_offset],
                self._ids[self._prefix_offset:])

    def _apply(self, prefix: str, full: str) -> None:
        """Takes the decoded `_pending` ids: new text, offsets, stop strings."""
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # an incomplete character: wait for more bytes
        start = len(self.text)
        self.text += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._stop:
            # Search only where a stop string could newly end.
            lo = max(0, start - max(len(s) for s in self._stop) + 1)
            hits = [(i, s) for s in self._stop if (i := self.text.find(s, lo)) >= 0]
            if hits:
                i, s = min(hits)
                self.text = self.text[:i + len(s) if self._include else i]
                self.stopped, self.stop_str = True, s

    def take_delta(self, final: bool = False) -> str:
        """The text not yet returned that may be shown now (all of it when final)."""
        final = final or self.stopped
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted:end]
        self._emitted = end
        return out

