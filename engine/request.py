"""A request as the scheduler sees it (vLLM v1's model: tokens vs computed tokens)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_hash import BlockHash, hash_blocks
from engine.sampling_params import SamplingParams
from engine.strategies import DEFAULT_POLICY, Policy

if TYPE_CHECKING:
    from engine.structured import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


@dataclass(eq=False, slots=True)
class Request:
    """All tokens (prompt + output) and how many of them have KV in the cache.

    There is no prefill phase: a request with `num_computed_tokens < num_tokens` needs
    those tokens computed, whether they are prompt or a freshly sampled token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    extra_key: bytes = b""
    # The model's EOS ids (engine/config.py stop_eos_ids), ignore_eos or not: they end it
    # unless it ignores EOS, and min_tokens holds them back either way.
    eos_token_ids: tuple[int, ...] = ()
    # Its bad words as token sequences (engine/token_masks.py bad_word_ids).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    # What ended it with "stop", as vLLM's stop_reason: the matched stop string or stop
    # token id; None for EOS (and a completed grammar).
    stop_reason: int | str | None = None
    num_computed_tokens: int = 0
    # Async scheduling: tokens a launched step is sampling whose ids the host has not
    # seen yet; the next step is scheduled on them (engine/async_step.py).
    num_output_placeholders: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    num_preemptions: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token
    first_token_time: float | None = None
    # A prefill producer keeps its blocks after finishing until the KV has been sent.
    hold_kv: bool = False
    # Sampling seed of an unseeded request, drawn once by the sampler from the engine's seed.
    sample_seed: int | None = None
    # Sampler-owned: (params, vocab, the sampling columns fixed for them), engine/sampler.py.
    sample_row: tuple[SamplingParams, int, tuple[float, ...]] | None = None
    # Structured outputs: this request's matcher (engine/structured.py); None: unconstrained.
    grammar: GrammarState | None = None
    # Who sent it: the tenant and its labels select scheduling strategies.
    tenant: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    # The client's request id (x-request-id), which request-id strategies target; the
    # engine's own id adds a unique suffix (gateway) or prefix (prefill). "": request_id.
    client_id: str = ""
    # Scheduler-owned: the strategies' policy for it, when it last joined the waiting line
    # (FCFS order among equals), when its running slice began, prompt tokens charged (VTC).
    policy: Policy = DEFAULT_POLICY
    queued_time: float = 0.0
    slice_start: float = 0.0
    num_prompt_charged: int = 0
    scheduled_time: float | None = None  # first admission (the end of its queue time)
    # Parallel sampling (n / best_of): which sample this is, and on the sample that
    # prefills, the other samples waiting for its prompt KV (engine/parallel.py).
    index: int = 0
    forks: list[Request] = field(default_factory=list)
    # Per prompt token 1..N-1 (prompt_logprobs), and the sum of the sampled tokens'.
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those being sampled: where the next token to sample sits."""
        return self.num_tokens + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs still to compute: such a request skips the prefix cache (its
        prompt positions must run through the model)."""
        k = self.sampling_params.prompt_logprobs
        return k is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Extends `block_hashes` to cover every full block of `all_token_ids`."""
        n = len(self.block_hashes)
        parent = self.block_hashes[-1] if n else None
        kw = {"parent": parent} if parent is not None else {}
        self.block_hashes += hash_blocks(self.all_token_ids, block_size, self.extra_key,
                                         start=n * block_size, **kw)
        return self.block_hashes
