"""Requests without token ids: `SimRequest` is the engine's Request whose token lists
are counters (the scheduler only counts tokens) and whose block hashes are given up
front (sim/workload.py's BlockHasher), so no token is ever hashed.
"""

from __future__ import annotations

from typing import Any, cast

from engine.request import Request
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # never read


class Tokens:
    """A token list that only counts (len, append): what the scheduler reads."""

    __slots__ = ("n",)

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def append(self, token: int) -> None:
        self.n += 1

    def __getitem__(self, index: slice) -> list[int]:
        return []  # no ids to give: the pool's BlockStored events carry none here


class SimRequest(Request):
    """engine.request.Request with counting token lists and precomputed hashes."""

    max_output = 0  # the client's max_tokens: the trace's output length

    def __post_init__(self) -> None:
        self.all_token_ids = cast(list[int], Tokens(len(self.prompt_token_ids)))
        self.output_token_ids = cast(list[int], Tokens())

    # Request's counts, read off the Tokens (no __len__ call: the scheduler asks often)
    @property
    def num_tokens(self) -> int:
        return self.all_token_ids.n  # type: ignore[attr-defined]

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_token_ids.n  # type: ignore[attr-defined]

    @property
    def num_output_tokens(self) -> int:
        return self.output_token_ids.n  # type: ignore[attr-defined]

    def update_block_hashes(self, block_size: int) -> list[Any]:
        return self.block_hashes  # every full block's hash is known from the start

    def hand_ahead(self, n: int) -> None:
        """Counts `n` tokens more (negative: fewer) as sampled, so that the scheduler
        gives a decoding request the next n + 1 tokens in one step."""
        cast(Tokens, self.all_token_ids).n += n
        cast(Tokens, self.output_token_ids).n += n


def make_request(request_id: str, prompt_len: int, hashes: list[Any], arrival: float,
                 hold_kv: bool = False, max_output: int = 0) -> SimRequest:
    req = SimRequest(request_id, cast(list[int], Tokens(prompt_len)), PARAMS,
                     arrival_time=arrival, hold_kv=hold_kv, block_hashes=hashes)
    req.max_output = max_output
    return req
