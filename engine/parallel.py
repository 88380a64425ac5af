"""Parallel sampling (`n`, `best_of`): several samples of one prompt from ONE prefill.

The request the caller names is sample 0. It carries the other samples in `forks`
until its prompt's KV is computed (or has arrived from a prefill worker); the model
runner then draws every sample's first token from that one logits row, and the engine
forks the samples onto the prompt's blocks (full blocks shared by reference, the last
partial block copied: engine/kv_cache_manager.py `fork`). From there each sample is
an ordinary request.

A `SampleGroup` gathers the samples' outputs under the caller's request id: each
output names its sample (`index`, as vLLM numbers them) and `finish_reason` marks the
end of a sample; `finished` marks the group's last output. With best_of > n every
output is held until all samples ended, then the n with the highest cumulative
logprob are returned (whole, re-indexed 0..n-1), as vLLM's best_of does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.outputs import RequestOutput
from engine.request import Request


def make_forks(parent: Request) -> list[Request]:
    """The samples 1..best_of-1 of `parent`'s prompt (sample i of a seeded request is
    seeded seed + i, as vLLM does). Sets `parent.forks`; returns them."""
    p = parent.sampling_params
    forks = []
    for i in range(1, p.num_samples):
        params = replace(p, seed=None if p.seed is None else (p.seed + i) % 2**63)
        forks.append(Request(f"{parent.request_id}#{i}", list(parent.prompt_token_ids), params,
                             extra_key=parent.extra_key, eos_token_ids=parent.eos_token_ids,
                             bad_words_token_ids=parent.bad_words_token_ids,
                             priority=parent.priority, arrival_time=parent.arrival_time,
                             index=i, tenant=parent.tenant, labels=parent.labels,
                             client_id=parent.client_id,
                             # structured outputs: each sample walks its own grammar
                             grammar=parent.grammar.fork() if parent.grammar else None))
    parent.forks = forks
    return forks


@dataclass(slots=True)
class SampleGroup:
    request_id: str  # the caller's id (sample 0's)
    n: int
    members: list[Request]
    hold: bool = False  # best_of > n: outputs wait for the ranking
    strip_logprobs: bool = False  # logprobs were only computed to rank (not asked for)
    live: int = 0
    held: list[RequestOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.live = len(self.members)

    @classmethod
    def of(cls, parent: Request) -> SampleGroup:
        """The group of `parent` and its forks (made here). best_of > n needs every
        sampled token's logprob to rank: asked for here if the caller did not."""
        p = parent.sampling_params
        hold = p.num_samples > p.n
        strip = hold and p.logprobs is None
        if strip:
            p.logprobs = 0
        return cls(parent.request_id, p.n, [parent, *make_forks(parent)], hold, strip)

    def add(self, out: RequestOutput) -> list[RequestOutput]:
        """A member's output -> the outputs to deliver now."""
        out.request_id = self.request_id
        if out.finish_reason is None:
            return [] if self.hold else [out]
        self.live -= 1
        if not self.hold:
            out.finished = self.live == 0
            return [out]
        self.held.append(out)
        if self.live:
            return []
        best = sorted(self.held, key=lambda o: -o.cumulative_logprob)[:self.n]
        for i, o in enumerate(best):
            o.index, o.finished = i, i == len(best) - 1
            if self.strip_logprobs:
                o.logprobs = None
        return best
