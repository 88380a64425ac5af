"""Per-request sampling settings (torch-free; the gateway validates with them)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output text (engine/structured.py compiles it with xgrammar).

    `spec` by kind: json_schema, a serialized JSON Schema; json_object, unused (any JSON
    object); regex, the pattern; choice, unused (`choices` holds the allowed strings);
    grammar, EBNF in xgrammar's (GBNF) syntax. `any_whitespace` False (vLLM's
    disable_any_whitespace): JSON kinds allow xgrammar's one layout only (separators
    ", " and ": ", as json.dumps writes them; no other whitespace).
    """

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    any_whitespace: bool = True

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}, "
                             f"got {self.kind!r}")
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise ValueError("a choice constraint needs a non-empty list of non-empty "
                                 "strings")
        elif self.kind != "json_object" and not self.spec:
            raise ValueError(f"the {self.kind} constraint is empty")

    @property
    def key(self) -> tuple[str, str, tuple[str, ...], bool]:
        """What the compiled grammar depends on (the compile cache's key)."""
        return self.kind, self.spec, self.choices, self.any_whitespace


class RequestOutputKind(enum.Enum):
    """What a request's outputs carry (vLLM's RequestOutputKind). Every output has the
    delta since the one before (`new_token_ids`, `new_text`) and the count so far
    (`num_output_tokens`); the kind says what `token_ids`, `text` and `logprobs` hold:

    CUMULATIVE: everything so far, on every output.
    DELTA: the delta only (`token_ids` is `new_token_ids`, `text` is `new_text`), so an
        output costs what it adds, not what the request holds (streaming servers).
    FINAL_ONLY: one output, when the request ends, with everything (offline batches);
        a prefill producer (`hold_kv`) still reports its KV progress every step.
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. `temperature == 0` is greedy.

    `top_k` None (or 0) and `top_p` 1.0 disable those filters. `stop` strings are cut
    from the output text; `stop_token_ids` end generation and stay in token_ids.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    # vLLM's min_p: after temperature, tokens less likely than min_p times the most
    # likely one are dropped (0 disables).
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the matched stop string ends the text
    logprobs: int | None = None  # None: none; n: the sampled token's and the top n
    # vLLM's penalties: presence/frequency on output tokens, repetition on prompt+output.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured: StructuredOutput | None = None  # constrained decoding (xgrammar)
    # Parallel samples of one prompt: `best_of` are drawn (one prefill, forked KV) and
    # the `n` with the highest cumulative logprob returned. None: best_of == n.
    n: int = 1
    best_of: int | None = None
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's and the top k
    # Added to the raw logits; each bias is clamped to [-100, 100] (vLLM's).
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many were sampled
    # vLLM's: only these ids are drawn (None: any); no bad word's tokens complete it
    # (engine/token_masks.py).
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    # `bad_words` as token sequences, set once per request by LLMEngine.validate (vLLM's
    # update_from_tokenizer) for the words and vocabulary size in `bad_words_key`: params
    # whose words changed, or met another model, are tokenized again. A copy made with
    # dataclasses.replace starts without them.
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False,
                                                        repr=False, compare=False)
    bad_words_key: tuple[tuple[str, ...], int] | None = field(default=None, init=False,
                                                              repr=False, compare=False)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # what outputs carry

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = None
        # vLLM's seeds are any int64, -1 meaning none; the sampler's are [0, 2**63).
        if self.seed == -1:
            self.seed = None
        elif isinstance(self.seed, int) and -2**63 <= self.seed < 0:
            self.seed += 2**63
        # vLLM's SamplingParams.from_optional: each bias clamped to [-100, 100]; what is
        # no number (NaN included) stays for validate() to refuse.
        self.logit_bias = {t: min(100.0, max(-100.0, float(b))) if _is_number(b) else b
                           for t, b in (self.logit_bias or {}).items()}
        self.bad_words = list(dict.fromkeys(self.bad_words or []))
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)

    @property
    def num_samples(self) -> int:
        """Samples drawn from the prompt (best_of, else n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises ValueError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) \
                or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or None disables), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # also rejects NaN
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty < float("inf"):  # vLLM's: finite, above 0
            raise ValueError(f"repetition_penalty must be a finite number above 0, got "
                             f"{self.repetition_penalty}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n!r}")
        if self.best_of is not None and (not isinstance(self.best_of, int)
                                         or self.best_of < self.n):
            raise ValueError(f"best_of must be at least n ({self.n}), got {self.best_of!r}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens!r}")
        # vLLM's SamplingParams.verify: ids index the logits, so each must be below the
        # model's vocabulary size.
        if not all(_is_int(t) for t in self.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids, got {list(self.logit_bias)}")
        outside = [t for t in self.logit_bias if not _in_vocab(t, vocab_size)]
        if outside:
            raise ValueError(f"token_id(s) {outside} in logit_bias contain out-of-vocab token "
                             f"ids. Vocabulary size: {vocab_size}")
        for bias in self.logit_bias.values():
            if not _is_number(bias):
                raise ValueError(f"logit_bias values must be numbers, got {bias!r}")
            if not -100.0 <= bias <= 100.0:  # set after construction, past its clamp
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r}")
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not allowed:
                raise ValueError("allowed_token_ids is not allowed to be empty")
            if not all(_is_int(t) and _in_vocab(t, vocab_size) for t in allowed):
                raise ValueError("allowed_token_ids contains out-of-vocab token id!")
        if not all(isinstance(w, str) and w for w in self.bad_words):
            raise ValueError("bad_words cannot contain an empty string")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"stop_token_ids holds {t!r}, not a token id of this model")
        if self.structured is not None:
            self.structured.validate()
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got "
                             f"{self.output_kind!r}")


def _is_int(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v  # not NaN


def _in_vocab(t: int, vocab_size: int | None) -> bool:
    """`vocab_size` None: any id a logits row could have (int32)."""
    return 0 <= t < (2**31 if vocab_size is None else vocab_size)
