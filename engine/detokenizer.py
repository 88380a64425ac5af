"""Incremental detokenization with stop strings, for streaming.

Decoding token by token breaks multi-byte characters and word-piece joins, so we keep
vLLM's two offsets: text up to `read_offset` has been emitted; decoding from
`prefix_offset` gives the context the next piece is joined to. The tokenizer's own
stream (`Tokenizer.decode_stream`) runs that same algorithm natively and is the usual
path; the offsets follow it, so a request continues on them, from the same state, where
the stream cannot start (its context's text ends with a replacement character) or
refuses a decode, and goes back to a stream started from their state at the next text
they return.

The context comes from the prompt's end as in vLLM's fast detokenizer: the shortest
suffix of its last `PROMPT_TAIL` ids (4 ids at least) whose text has no replacement
character, so it does not begin inside a character that byte tokens spell; a prompt
ending inside a character gives that character's ids to the decoder after its context,
their text not shown, and the output id that completes the character shows it whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer

# Pieces of text kept before they are joined into one string: a long output copies its
# text once per this many pieces instead of once per token.
_JOIN_EVERY = 32

# The prompt ids the context is chosen from (the caller passes the prompt's last ones).
PROMPT_TAIL = 28
_MIN_CONTEXT, _MAX_CONTEXT = 4, 23


def _ends_clean(tokenizer: Tokenizer, ids: list[int], skip: bool) -> bool:
    """Whether `ids` end on a whole character: the text of one of their last 4 ids (the
    last character's bytes begin in one of them) has an end, not a replacement
    character. (The text of all of them may not: byte-fallback tokenizers decode a run
    of byte tokens that begins inside a character as one replacement character a byte.)
    Ids without text (skipped special tokens) at the end are not a whole character: the
    decoder reads past them only with text after them."""
    for n in range(1, min(len(ids), 4) + 1):
        text = tokenizer.decode(ids[-n:], skip)
        if text and not text.endswith("\ufffd"):
            return True
    return False


def prompt_context(tokenizer: Tokenizer, tail: Sequence[int], skip: bool = True,
                   ) -> tuple[list[int], list[int]]:
    """The decoding context from the prompt's last ids, and the ids after it that the
    decoder holds unread: those of a character the prompt ends inside (one never
    completed stays there) and ids without text after them. The context is the
    shortest suffix, from `_MIN_CONTEXT` ids, whose text has no replacement character
    (ids from the middle of a character, which byte-fallback tokenizers decode with the
    rest of their run as one replacement character a byte), else all the ids: vLLM's
    FastIncrementalDetokenizer."""
    tail = list(tail)
    end = len(tail)
    while end and not _ends_clean(tokenizer, tail[:end], skip):
        end -= 1
    clean, partial = tail[:end], tail[end:]
    if end > _MIN_CONTEXT:
        for n in range(_MIN_CONTEXT, min(end, _MAX_CONTEXT) + 1):
            if "\ufffd" not in tokenizer.decode(clean[-n:], skip):
                return clean[-n:], partial
    return clean, partial


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    With stop strings, text that could be the start of a stop string is held back
    until it is known not to be, so a stream never shows text past a stop.

    The text is kept as pieces, joined when it is read whole (`text`, `shown`) and
    every `_JOIN_EVERY` pieces: a step appends its piece instead of copying a long
    output's whole text.
    """

    __slots__ = ("_tok", "_ids", "_prefix_offset", "_read_offset", "_stream", "_stop",
                 "_hold", "_reach", "_include", "_skip", "_min", "_count", "_parts",
                 "_size", "_emitted", "stopped", "stop_str")

    def __init__(self, tokenizer: Tokenizer, prompt_tail: Sequence[int],
                 stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 include_stop: bool = False, min_tokens: int = 0) -> None:
        """`prompt_tail`: the prompt's last `PROMPT_TAIL` ids (or all of a shorter one).
        `include_stop`: the text ends with the matched stop string (vLLM's
        include_stop_str_in_output); nothing is held back then, as in vLLM.
        `min_tokens`: stop strings are searched only from the output token after the
        first `min_tokens` on (a match may begin in their text), as vLLM v1."""
        self._tok = tokenizer
        # A few prompt tokens give the first output token its joining context; the ids
        # of a character the prompt ends inside follow it, their text not yet read.
        context, partial = prompt_context(tokenizer, prompt_tail, skip_special_tokens)
        self._ids: list[int] = context + partial
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._stream = stream = tokenizer.decode_stream(context, skip_special_tokens)
        if stream is not None and partial:
            try:  # (their text is incomplete: the stream returns None)
                if any(stream(tid) is not None for tid in partial):
                    self._stream = None
            except Exception:  # noqa: BLE001 (tokenizers raises a bare Exception)
                self._stream = None  # the offsets take over, as in `add_one`
        self._stop = list(stop)
        # A stop string ending in new text begins at most `_reach` chars before it.
        self._reach = max((len(s) for s in self._stop), default=1) - 1
        self._hold = 0 if include_stop else self._reach
        self._include = include_stop
        self._skip = skip_special_tokens
        self._min = min_tokens
        self._count = 0  # output tokens taken, with or without their text
        # The output text so far (the stop string cut unless included), in pieces.
        self._parts: list[str] = []
        self._size = 0  # its chars
        self._emitted = 0  # its chars already returned
        self.stopped = False
        self.stop_str: str | None = None  # the stop string that matched

    def add(self, token_ids: Sequence[int]) -> None:
        """Appends output tokens (none after a stop string has matched)."""
        for tid in token_ids:
            if self.stopped:
                break
            self.add_one(tid)

    def add_one(self, token_id: int) -> None:
        """Appends one output token (the caller checks `stopped` first): a decode step's
        work per request, one native call on the stream."""
        self._count += 1
        ids = self._ids
        ids.append(token_id)
        stream = self._stream
        if stream is not None:
            try:
                new = stream(token_id)
            except Exception:  # noqa: BLE001 (tokenizers raises a bare Exception)
                # The stream refuses a window whose decode does not begin with the text
                # already returned (invalid UTF-8 from byte-fallback tokens, re-decoded
                # as replacement characters): the offsets take the token as they are.
                stream = self._stream = None
                new = self._offsets_text()
        else:
            new = self._offsets_text()
        if new is None:
            return  # an incomplete character: wait for more bytes
        p = self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if stream is None:  # the stream continues from the offsets' state where it can
            self._stream = self._tok.decode_stream(ids[p:], self._skip)
        if self._stop:
            if self._count > self._min and self._stops_in(new):
                return
        parts = self._parts
        parts.append(new)
        self._size += len(new)
        if len(parts) > _JOIN_EVERY:
            self._parts = ["".join(parts)]

    def _stops_in(self, new: str) -> bool:
        """Whether a stop string ends in `new` (the text's next piece); then the text
        ends at the first listed one's first match, with `new` taken up to there."""
        before = self._tail(min(self._reach, self._size))
        context = before + new
        for s in self._stop:
            if (i := context.find(s, max(0, len(before) - len(s) + 1))) >= 0:
                end = self._size - len(before) + i + (len(s) if self._include else 0)
                self._parts = [("".join(self._parts) + new)[:end]]
                self._size = end
                self.stopped, self.stop_str = True, s
                return True
        return False

    def _tail(self, n: int) -> str:
        """The text's last `n` chars (held back, or a step's new text: a few pieces)."""
        if n <= 0:
            return ""
        parts = self._parts
        i, got = len(parts), 0
        while got < n:
            i -= 1
            got += len(parts[i])
        # Only the end of `parts[i]` (often the long joined piece) is copied.
        return parts[i][got - n:] + "".join(parts[i + 1:])

    def _offsets_text(self) -> str | None:
        """The text the newest id completes, decoded from the offsets; None while its
        character is incomplete. The joining context, mostly the one id before it, is a
        memory hit (Tokenizer.piece)."""
        ids = self._ids
        p, r = self._prefix_offset, self._read_offset
        tok, skip = self._tok, self._skip
        prefix = tok.piece(ids[p], skip) if r - p == 1 else tok.decode(ids[p:r], skip)
        full = tok.decode(ids[p:], skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        return full[len(prefix):]

    def skip(self, token_ids: Sequence[int]) -> None:
        """Adds tokens whose text an earlier stream of this request already showed
        (fail-over): the text holds them (stop strings see it whole), and what a stream
        would have returned by now is marked returned, so the next delta continues
        exactly where that stream left off."""
        self.add(token_ids)
        self.take_delta()

    def take_delta(self, final: bool = False) -> str:
        """The text not yet returned that may be shown now (all of it when final)."""
        unreturned = self._size - self._emitted
        n = unreturned if final or self.stopped else unreturned - self._hold
        if n <= 0:
            return ""
        self._emitted += n
        return self._tail(unreturned)[:n]

    @property
    def text(self) -> str:
        """The output text so far (the stop string cut unless included)."""
        if len(self._parts) != 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0]

    @property
    def shown(self) -> str:
        """The text returned so far: a running request's cumulative text, without
        what is held back (vLLM trims the stop-string buffer alike)."""
        text = self.text
        return text if self._emitted == len(text) else text[:self._emitted]
