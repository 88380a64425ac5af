"""Tokens a request may not draw, as vLLM v1 bars them: every token outside its
`allowed_token_ids`, and the last token of a bad word whose other tokens end its output
(vllm/v1/sample/ops/bad_words.py). The sampler applies them to a copy of the logits,
before logit_bias, min_tokens and the penalties; logprobs stay those of the raw logits.

Bad words become token sequences once, when the request is added (engine/tokenizer.py
`bad_word_ids`, vLLM's SamplingParams.update_from_tokenizer). Under async scheduling the
newest output token may still be on the device: a prefix that ends in it is compared
there (`PendingIds`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from engine.request import Request

if TYPE_CHECKING:
    from engine.sampler import PendingIds


def has_token_masks(r: Request) -> bool:
    return bool(r.sampling_params.allowed_token_ids) or bool(r.bad_words_token_ids)


def apply_token_masks(logits: torch.Tensor, requests: Sequence[Request],
                      pending: PendingIds | None,
                      to_device: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A copy of `logits` [B, V] with -inf where a row may not draw the token. `pending`:
    the step in flight (async scheduling), holding rows' placeholder tokens."""
    vocab = logits.shape[1]
    allowed_rows: list[tuple[int, list[int]]] = []
    barred: list[tuple[int, int]] = []  # (row, token)
    # Bad words of 2+ tokens: (row, last token, prefix the output must end with); a
    # prefix entry -1 - j is the placeholder token of pending row j.
    checks: list[tuple[int, int, list[int]]] = []
    for i, r in enumerate(requests):
        allowed = r.sampling_params.allowed_token_ids
        if allowed:
            allowed_rows.append((i, allowed))
        if not r.bad_words_token_ids:
            continue
        past = r.output_token_ids
        if r.num_output_placeholders:
            if pending is None or r.request_id not in pending.rows:
                raise RuntimeError(f"request {r.request_id} has a placeholder token but no "
                                   "step in flight holds it")
            past = [*past, -1 - pending.rows[r.request_id]]
        for word in r.bad_words_token_ids:
            if len(word) > len(past) + 1:
                continue
            tail = past[1 - len(word):] if len(word) > 1 else []
            if all(a >= 0 for a in tail):  # known: compare here
                if tail == word[:-1]:
                    barred.append((i, word[-1]))
            else:
                checks.append((i, word[-1], [*tail, *word[:-1]]))
    out = logits.clone()
    if allowed_rows:  # dense only for these rows
        keep = torch.zeros((len(allowed_rows), vocab), dtype=torch.bool)
        for j, (_, ids) in enumerate(allowed_rows):
            keep[j, ids] = True
        rows = to_device(torch.tensor([i for i, _ in allowed_rows]))
        out[rows] = out[rows].masked_fill(~to_device(keep), float("-inf"))
    if barred:
        cells = to_device(torch.tensor(barred))
        out[cells[:, 0], cells[:, 1]] = float("-inf")
    if checks:
        assert pending is not None
        out = _device_checks(out, checks, pending, vocab, to_device)
    return out


def _device_checks(logits: torch.Tensor, checks: list[tuple[int, int, list[int]]],
                   pending: PendingIds, vocab: int,
                   to_device: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Bars each check's token where its row's output, placeholders read from `pending`,
    ends with its prefix. A check's list is the output's tail, then the prefix."""
    width = max(len(c[2]) for c in checks) // 2
    table = torch.full((len(checks), 2 + 2 * width), vocab, dtype=torch.int64)
    for k, (row, tok, pair) in enumerate(checks):
        n = len(pair) // 2
        table[k, 0], table[k, 1] = row, tok
        table[k, 2:2 + n] = torch.tensor(pair[:n])  # pad: vocab == vocab
        table[k, 2 + width:2 + width + n] = torch.tensor(pair[n:])
    t = to_device(table)
    tail = t[:, 2:2 + width]
    slot = tail < 0
    filled = torch.where(slot, pending.ids[(-1 - tail).clamp_(min=0)], tail)
    match = (filled == t[:, 2 + width:]).all(dim=1)
    return logits.index_put((t[:, 0], t[:, 1]),
                            torch.where(match, float("-inf"), 0.0).to(logits.dtype),
                            accumulate=True)
