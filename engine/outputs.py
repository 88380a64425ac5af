"""What the engine hands back for a request, step by step."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class RankedLogprobs(dict[int, float]):
    """A prompt position's logprobs: the prompt token's first, then the top k, best
    first; `rank` is the prompt token's 1-based rank among all tokens (those at least as
    likely, vLLM's Logprob.rank)."""

    __slots__ = ("rank",)

    def __init__(self, items: Mapping[int, float], rank: int) -> None:
        super().__init__(items)
        self.rank = rank


@dataclass(slots=True)
class RequestOutput:
    """One update for a request.

    `new_token_ids` / `new_text` are the delta since the previous update (for
    streaming) and `num_output_tokens` the count so far; `token_ids`, `text` and
    `logprobs` hold everything so far or only the delta, as the request's
    `SamplingParams.output_kind` says (engine/sampling_params.py). `finish_reason` is
    set on the last update: "stop" (EOS, stop token or stop string), "length", "abort"
    or "error" (then `error` says why).

    The engine builds it with positional arguments up to `num_computed_tokens`
    (engine/output_processor.py `_output`): a new field goes after them, or there too.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    num_output_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    # With finish_reason "stop": the matched stop string or stop token id (vLLM's
    # stop_reason); None for EOS.
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    first_token_time: float | None = None  # monotonic seconds
    scheduled_time: float | None = None  # monotonic seconds: first scheduled (queue time)
    # per output token of `token_ids`, when asked for
    logprobs: list[dict[int, float]] | None = None
    # Parallel sampling (engine/parallel.py): the sample this output belongs to. Then
    # `finish_reason` marks the end of this sample and `finished` the last output of
    # the whole request.
    index: int = 0
    cumulative_logprob: float = 0.0  # of the sampled tokens (when logprobs were computed)
    prompt_logprobs: list[dict[int, float]] | None = None  # prompt tokens 1..N-1, if asked
    # Producers (prefill for a remote decode) only: KV progress, so the KV of finished
    # blocks can be sent while later chunks compute.
    num_computed_tokens: int = 0
    block_ids: list[int] | None = None
    # On CUDA: an event recorded on the compute stream right after the forward that
    # computed `num_computed_tokens` (torch.cuda.Event). A transfer of these blocks waits
    # on it, on the device, and so overlaps the forwards queued after it. None: the KV is
    # in place already (CPU forwards are synchronous).
    kv_ready: Any = None


class SampledTokens(Mapping[str, tuple[int, Any]]):
    """A step's sampled tokens, from the model runner: row i is `rows[i]`'s
    (`tokens[i]`, `logprobs[i]`). Read by request id (a dict made on first use), or,
    when `aligned` (the rows are the step's sampling requests in the scheduler's order,
    no parallel-sample forks among them), in row order along the scheduled requests."""

    __slots__ = ("rows", "tokens", "logprobs", "aligned", "_by_id")

    def __init__(self, rows: Sequence[Any], tokens: Sequence[int], logprobs: Sequence[Any],
                 aligned: bool) -> None:
        self.rows, self.tokens, self.logprobs = rows, tokens, logprobs
        self.aligned = aligned
        self._by_id: dict[str, tuple[int, Any]] | None = None

    def along(self, scheduled: Sequence[Any]) -> tuple[Sequence[int | None], Sequence[Any]]:
        """(tokens, logprobs) of each of `scheduled` (the step's ScheduledRequests, in
        order): its request's, None where it sampled nothing."""
        if self.aligned and len(self.rows) == len(scheduled):
            return self.tokens, self.logprobs  # every request sampled (decode)
        got = [self.get(s.request.request_id) for s in scheduled] if not self.aligned \
            else self._walk(scheduled)
        return ([None if g is None else g[0] for g in got],
                [None if g is None else g[1] for g in got])

    def _walk(self, scheduled: Sequence[Any]) -> list[tuple[int, Any] | None]:
        out: list[tuple[int, Any] | None] = []
        rows, j, n = self.rows, 0, len(self.rows)
        for s in scheduled:
            if j < n and rows[j] is s.request:
                out.append((self.tokens[j], self.logprobs[j]))
                j += 1
            else:
                out.append(None)
        return out

    def _map(self) -> dict[str, tuple[int, Any]]:
        if self._by_id is None:
            self._by_id = {r.request_id: (t, lp) for r, t, lp
                           in zip(self.rows, self.tokens, self.logprobs, strict=True)}
        return self._by_id

    def __getitem__(self, request_id: str) -> tuple[int, Any]:
        return self._map()[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._map())

    def __len__(self) -> int:
        return len(self.rows)
