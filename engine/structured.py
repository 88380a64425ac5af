"""Structured outputs: constrained decoding with xgrammar.

`StructuredOutputs` (one per engine) turns a request's `StructuredOutput` into an
xgrammar `CompiledGrammar`, cached per (kind, spec), and gives every constrained request
its own `GrammarState` (a `GrammarMatcher`). Each step the sampler calls
`apply_grammar_masks`: the matchers of the constrained rows fill one host bitmask
(one bit per vocabulary entry: may this token come next), which goes to the logits'
device in one copy and masks the disallowed entries to -inf for every row at once.

A state advances lazily: `GrammarState.advance(output_token_ids)` feeds the tokens it
has not seen yet. So whatever put tokens into a request's output — this engine's
sampler, a remote prefill's first token, tokens resumed after a fail-over — the matcher
catches up before the next mask, and nothing else has to remember to feed it. When the
grammar is complete the matcher accepts only a stop token; once it is terminated the
request finishes with "stop".

xgrammar (and torch with it) is imported on first use: engines that never see a
constrained request do not pay for it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

    from engine.request import Request

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """xgrammar could not compile the constraint; the message is xgrammar's."""


def _choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose only sentences are the choices (JSON string escapes are GBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar (0.2.x) compiles a length-bounded JSON string (minLength / maxLength) to this
# character class, which admits the control characters U+0000-U+001F that JSON forbids
# raw inside a string (its unbounded string rule excludes them). Rewritten in the
# schema's grammar before compiling, every finished output parses strictly.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def json_schema_grammar(schema: str, any_whitespace: bool = True) -> xgr.Grammar:
    """xgrammar's grammar for `schema`, with no raw control character inside any string."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace))
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


class StructuredOutputs:
    """Compiles constraints for one model's vocabulary and hands out grammar states.

    Thread-safe: `compile` runs on the caller's thread when a request is validated
    (before it is queued) and again, a cache hit, on the engine thread.
    """

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = 256) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str, str, tuple[str, ...], bool], xgr.CompiledGrammar] = \
            OrderedDict()
        self.compiles = 0  # cache misses (tests read it)

    def _make_compiler(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(self.model_dir, "tokenizer.json"))
        # Detection of the vocabulary's encoding (byte-level, byte-fallback, raw) is the
        # one xgrammar's own from_huggingface runs on the same tokenizer.json.
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
        vocab = tok.get_vocab(with_added_tokens=True)
        encoded = [""] * max(max(vocab.values()) + 1, 0)
        for text, i in vocab.items():
            encoded[i] = text
        # Special tokens are blanked: xgrammar then treats them as special (never part
        # of the text) instead of as their literal spelling, e.g. "<|eot_id|>" inside a
        # JSON string. Stop tokens stay allowed where the grammar may end.
        for i, t in tok.get_added_tokens_decoder().items():
            if t.special:
                encoded[i] = ""
        info = xgr.TokenizerInfo(encoded, meta["vocab_type"],
                                 vocab_size=max(self.vocab_size, len(encoded)),
                                 stop_token_ids=self.stop_token_ids,
                                 add_prefix_space=meta["add_prefix_space"])
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar for `spec` (cached). Raises GrammarError with xgrammar's
        message when the schema, regex or grammar cannot be compiled."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            if self._compiler is None:
                self._compiler = self._make_compiler()
            compiler = self._compiler
        try:
            compiled = self._compile(compiler, spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"invalid {spec.kind} for structured output: "
                               f"{_clean(str(e))}") from e
        with self._lock:
            self.compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(compiler: xgr.GrammarCompiler, spec: StructuredOutput) -> xgr.CompiledGrammar:
        kind = spec.kind
        if kind == "json_schema":
            json.loads(spec.spec)  # a clear "not JSON" error before xgrammar's
            # vLLM's default: any whitespace between tokens; schemas strict (no extra keys).
            return compiler.compile_grammar(json_schema_grammar(spec.spec,
                                                                spec.any_whitespace))
        if kind == "json_object":  # as vLLM: any object (xgrammar's builtin takes any value)
            return compiler.compile_grammar(json_schema_grammar('{"type": "object"}',
                                                                spec.any_whitespace))
        if kind == "regex":
            return compiler.compile_regex(spec.spec)
        if kind == "choice":
            return compiler.compile_grammar(_choice_grammar(spec.choices))
        if kind == "grammar":
            return compiler.compile_grammar(spec.spec)
        raise ValueError(f"unknown structured output kind {kind!r}")

    def new_state(self, spec: StructuredOutput) -> GrammarState:
        import xgrammar as xgr

        compiled = self.compile(spec)
        return GrammarState(xgr.GrammarMatcher(compiled), compiled.tokenizer_info.vocab_size)


def _clean(message: str) -> str:
    """xgrammar's message without its C++ location prefix ("[time] file.cc:12: ")."""
    head, sep, rest = message.partition(": ")
    if sep and head.startswith("[") and ".cc:" in head:
        return rest.strip()
    return message.strip()


class GrammarState:
    """One request's position in its grammar. `accepted` output tokens have been fed."""

    __slots__ = ("matcher", "vocab_size", "accepted", "rejected")

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the bitmask's width in tokens
        self.accepted = 0
        self.rejected: int | None = None  # a token the grammar did not allow

    def advance(self, output_token_ids: Sequence[int]) -> bool:
        """Feeds the output tokens not fed yet. False if one was rejected (it and the
        rest are not fed; the request cannot continue within its grammar)."""
        if self.rejected is not None:
            return False
        while self.accepted < len(output_token_ids):
            tok = output_token_ids[self.accepted]
            if self.matcher.is_terminated() or not self.matcher.accept_token(tok):
                self.rejected = tok
                return False
            self.accepted += 1
        return True

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fork(self) -> GrammarState:
        """An independent copy at the same position (a parallel sample of the prompt)."""
        out = GrammarState(self.matcher.fork(), self.vocab_size)
        out.accepted, out.rejected = self.accepted, self.rejected
        return out


def apply_grammar_masks(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Masks, in place, the entries of `logits` ([B, V], row b for requests[b]) that a
    constrained request's grammar does not allow next: one host bitmask filled by the
    constrained rows' matchers, one copy to the logits' device, one batched kernel over
    those rows (unconstrained rows are not touched)."""
    import xgrammar as xgr

    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return
    first = requests[rows[0]].grammar
    assert first is not None
    bitmask = xgr.allocate_token_bitmask(len(requests), first.vocab_size)  # all allowed
    for i in rows:
        r = requests[i]
        state = r.grammar
        assert state is not None
        # A state that fell out of its grammar (or ended) is finished by the engine
        # after this step; its row stays unmasked meanwhile.
        if state.advance(r.output_token_ids) and not state.terminated:
            state.matcher.fill_next_token_bitmask(bitmask, i)
    if logits.device.type == "cuda":
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device),
                                    vocab_size=min(logits.shape[-1], first.vocab_size),
                                    indices=rows)
