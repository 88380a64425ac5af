"""The harness's shared types: what a benchmark sends (`BenchRequest`), what comes back
(`RequestResult`) and the `Client` protocol every backend implements.

Ownership: datasets build `BenchRequest`s (immutable); a `Client` turns one into one
`RequestResult` and never raises for a failed request (the error is recorded in the
result, so error rates are measured, not crashed on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class BenchError(RuntimeError):
    """Bad harness input (dataset, option, SLO string) or an experiment that cannot run."""


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to send. `prompt` is token ids (sent as a token-id prompt, which the
    OpenAI completions API of splitserve and vLLM accept) or text."""

    prompt: tuple[int, ...] | str
    prompt_len: int
    output_len: int
    arrival_s: float | None = None  # trace replay: offset from the start of the run
    session: str | None = None  # multi-turn: turns of one session run in order
    turn: int = 0
    tag: str = ""  # a workload class ("long", "decode", ...) for per-class metrics

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise BenchError(f"prompt_len must be >= 1, got {self.prompt_len}")
        if self.output_len < 1:
            raise BenchError(f"output_len must be >= 1, got {self.output_len}")
        if isinstance(self.prompt, tuple) and len(self.prompt) != self.prompt_len:
            raise BenchError("prompt_len must equal the number of prompt token ids")


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it. Times are seconds; `start_s` is relative to the
    start of the phase; `itl_s` holds the gaps between consecutive content chunks."""

    ok: bool
    prompt_len: int
    output_len: int = 0  # output tokens received (usage when the server reports it)
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    error: str = ""
    tag: str = ""

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); undefined for fewer than two tokens."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_len < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1)


class Client(Protocol):
    """A backend the harness measures (OpenAI HTTP streaming, splitserve gRPC)."""

    name: str

    async def send(self, req: BenchRequest) -> RequestResult:
        """Sends `req`, streams the answer, returns the measured result (never raises
        for a failed request)."""
        ...

    async def close(self) -> None:
        ...
