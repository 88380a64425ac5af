"""Turns last-position logits into tokens: greedy, temperature, top-k, top-p, seeds.

Sampling uses the exponential-race trick (argmax of probs / Exp(1) noise), so a
seeded request draws its noise from its own generator and gets the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import Request
from engine.sampling_params import SamplingParams

Logprobs = dict[int, float]  # token id -> log-probability


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._default = torch.Generator(device=device)
        self._default.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def skip(self, request_id: str, params: SamplingParams, vocab_size: int) -> None:
        """Advances a seeded request's generator past one draw made elsewhere (the
        first token sampled by a remote prefill), so the rest of its stream is the
        one a single node would have produced."""
        if params.seed is not None and not params.greedy:
            torch.empty(vocab_size, device=self.device).exponential_(
                generator=self._generator(request_id, params))

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self._generators[request_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 ) -> tuple[list[int], list[Logprobs | None]]:
        """logits: [B, V] float32, one row per request. Returns one token id per row and,
        for rows that asked, the log-probabilities (of the raw logits, before
        temperature) of the sampled token and the top-n tokens."""
        request_ids = [r.request_id for r in requests]
        params = [r.sampling_params for r in requests]
        tokens = self._sample(logits, request_ids, params)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        lps: list[Logprobs | None] = [None] * len(params)
        if want:
            logp = logits[want].log_softmax(dim=-1)
            for row, i in enumerate(want):
                n = params[i].logprobs or 0
                top = logp[row].topk(n) if n else None
                entry = {tokens[i]: float(logp[row, tokens[i]])}
                if top is not None:
                    entry |= dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                lps[i] = entry
        return tokens, lps

    def _sample(self, logits: torch.Tensor, request_ids: list[str],
                params: list[SamplingParams]) -> list[int]:
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return [int(t) for t in greedy.tolist()]
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                             device=logits.device, dtype=torch.float32)
        logits = logits / temps.unsqueeze(1)
        logits = self._top_k_top_p(logits, params)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        for i, (rid, p) in enumerate(zip(request_ids, params, strict=True)):
            if not p.greedy:
                noise[i].exponential_(generator=self._generator(rid, p))
        sampled = (probs / noise.clamp_min(1e-10)).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        return [int(t) for t in torch.where(is_greedy, greedy, sampled).tolist()]

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        if all(p.top_k is None and p.top_p >= 1.0 for p in params):
            return logits
        vocab = logits.shape[-1]
        ks = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=logits.device)
        ps = torch.tensor([p.top_p for p in params], device=logits.device)
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        drop = ranks >= ks.unsqueeze(1)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= ps.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)
