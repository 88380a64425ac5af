"""Turns last-position logits into tokens: greedy, temperature, min-p, top-k, top-p, seeds,
presence/frequency/repetition penalties, logprobs.

Everything is batched tensor work on the logits' device with one host->device copy of
the per-row parameters (plus one of the token history when a row has a penalty) and
one device->host copy of the results. Under async scheduling a row's newest token may
still be on the device (`PendingIds`): the penalties' history takes it from there.

Random draws carry no generator state: the noise for vocabulary entry `v` of a row is
a pure function of (seed, position of the token being sampled, v), a counter-based
hash (`row_keys`, `uniform_noise`; on CUDA one fused Triton kernel draws the tokens,
the noise never written out, the logits read once unless min-p, top-k or top-p filter
them first). So a seeded request gets the same tokens whatever else is in the batch
and on whichever worker samples it: a remote prefill samples the first token, the
decode worker the rest, and after a fail-over the new worker continues the same
sequence, with nothing to hand over or skip.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.input_batch import plain_greedy
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.structured import apply_grammar_masks
from engine.token_masks import apply_token_masks, has_token_masks

Logprobs = dict[int, float]  # token id -> log-probability

_M32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # odd, spreads consecutive vocabulary ids over the 32-bit ring
_KEY_SALT = 0x85EBCA6B  # separates the two per-row keys


# -- counter-based RNG ---------------------------------------------------------------
# The per-row keys are made on the host (numpy, uint32 arithmetic wraps mod 2**32); the
# per-entry noise on the device. In torch the values are 32-bit unsigned integers held
# in int64 tensors, every intermediate in [0, 2**63), so nothing relies on signed
# overflow (undefined in the C++ kernels, and shifts of negative numbers would be
# arithmetic, not logical). The Triton kernel (engine.kernels.gumbel_race) computes
# the same bits in uint32 registers.

def _mix32_np(x: np.ndarray) -> np.ndarray:
    """lowbias32 (C. Wellons' hash prospector) on uint32 arrays: a bijection on 32-bit
    values with near-ideal avalanche, so neighbouring inputs give unrelated outputs."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def row_keys(seeds: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two 32-bit keys (uint32) per row from seeds in [0, 2**63) and positions in
    [0, 2**31): the seed's halves and the position are absorbed one at a time through
    the mixer."""
    seeds = np.asarray(seeds, dtype=np.uint64)
    with np.errstate(over="ignore"):
        k = _mix32_np((seeds >> np.uint64(32)).astype(np.uint32) ^ np.uint32(_GOLDEN32))
        k = _mix32_np(k ^ (seeds & np.uint64(_M32)).astype(np.uint32))
        k = _mix32_np(k ^ np.asarray(positions).astype(np.uint32))
        return k, _mix32_np(k ^ np.uint32(_KEY_SALT))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x in [0, 2**32) and a 32-bit constant c, without overflow:
    the low 31 bits of c multiply exactly (< 2**63); its top bit contributes
    x * 2**31 mod 2**32 == (x & 1) << 31."""
    y = x * (c & 0x7FFFFFFF)
    if c >> 31:
        y = y + ((x & 1) << 31)
    return y & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """`_mix32_np` on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(k1: torch.Tensor, k2: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1): entry (b, v) = U(row b's keys `row_keys`, v),
    the keys int64 tensors holding 32-bit values."""
    ids = _mul32(torch.arange(vocab_size, device=k1.device, dtype=torch.int64), _GOLDEN32)
    # A second keyed round, so rows whose first keys differ by a multiple of the
    # stride do not get the same noise shifted along the vocabulary.
    x = _mix32((k1.unsqueeze(1) + ids) & _M32)
    x = _mix32(x ^ k2.unsqueeze(1))
    # 23 bits so that (h + 0.5) is exact in float32: u stays strictly inside (0, 1),
    # -log(u) strictly positive and its log finite.
    return ((x >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)


def gumbel_race(logits: torch.Tensor, temperatures: torch.Tensor, k1: torch.Tensor,
                k2: torch.Tensor) -> torch.Tensor:
    """The exponential race, the torch reference of engine.kernels.gumbel_race: row b's
    argmax over v of logits[b, v] / temperatures[b] - log(-log U(b, v)). With
    E = -log U ~ Exp(1) this is argmax(softmax(logits / t) / E), which picks entry v
    with probability softmax(logits / t)[v]; the log form needs no softmax."""
    noise = uniform_noise(k1, k2, logits.shape[1]).log_().neg_().log_()
    return (logits / temperatures.unsqueeze(1) - noise).argmax(dim=-1)


# -- logits processing ---------------------------------------------------------------

def apply_penalties(logits: torch.Tensor, tokens: torch.Tensor, prompt_lens: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties on a copy of `logits` [B, V]. `tokens` [B, L] holds each row's
    history padded with V, its first `prompt_lens[b]` entries prompt, the rest output.
    Repetition scales every token seen in prompt or output (positive logits divided,
    others multiplied); frequency subtracts per output occurrence, presence once."""
    b, v = logits.shape
    cols = torch.arange(tokens.shape[1], device=logits.device)
    out_tokens = tokens.masked_fill(cols.unsqueeze(0) < prompt_lens.unsqueeze(1), v)
    # Column V collects the padding and is dropped.
    counts = torch.zeros(b, v + 1, device=logits.device, dtype=logits.dtype)
    counts.scatter_add_(1, out_tokens, torch.ones_like(out_tokens, dtype=logits.dtype))
    counts = counts[:, :v]
    seen = torch.zeros(b, v + 1, device=logits.device, dtype=torch.bool)
    seen.scatter_(1, tokens, True)
    rep = torch.where(seen[:, :v], repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency.unsqueeze(1) * counts
    return logits - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def min_p_filter(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min-p on temperature-scaled logits [B, V]: sets to -inf every token whose
    probability is below min_p[b] times the row's highest (0 keeps all)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                ) -> torch.Tensor:
    """Sets to -inf what top-k ([B] int64, V disables) and top-p ([B], 1 disables) drop."""
    vocab = logits.shape[-1]
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


# -- the sampler ---------------------------------------------------------------------

@dataclass(slots=True)
class _Rows:
    """Per-row parameters on the device, one column each of a single copied tensor."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    key1: torch.Tensor  # the noise's keys (`row_keys` of seed and position)
    key2: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    prompt_len: torch.Tensor
    min_p: torch.Tensor


@dataclass(slots=True)
class PendingIds:
    """Async scheduling: the ids the step in flight sampled, on the device (`ids`), and
    the row of each request among them (`rows`). A request with an output placeholder
    finds its newest token there before the host has read it."""

    ids: torch.Tensor
    rows: dict[str, int]


def has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 \
        or p.repetition_penalty != 1.0


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        # Host-side: it only hands out one seed per unseeded request, never noise.
        self._seeds = random.Random(seed)
        self._race = gumbel_race
        if device.type == "cuda":  # the same draws, fused: the noise never leaves registers
            from engine.kernels import gumbel_race as fused_race
            self._race = fused_race

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 ) -> tuple[list[int], list[Logprobs | None]]:
        """logits: [B, V] float32, one row per request, the token to sample sits at
        position `request.num_tokens_with_placeholders`. Returns one token id per row
        and, for rows that asked, the log-probabilities (of the raw logits, before
        penalties and temperature) of the sampled token and the top-n tokens."""
        return self.sample(logits, requests).result()

    def sample(self, logits: torch.Tensor, requests: Sequence[Request],
               pending: PendingIds | None = None, plain: bool = False) -> DeviceTokens:
        """`__call__`'s tokens, left on the device (the host reads them with `result`).
        `pending`: the step in flight, which holds the placeholder tokens of `requests`
        (async scheduling); the penalties count them as the synchronous loop would.
        `plain`: the caller knows every row is plain greedy without logprobs (the
        persistent batch's flags, engine/input_batch.py): no look at the requests."""
        if not requests:
            return DeviceTokens(torch.empty(0, dtype=torch.int64, device=logits.device), [])
        if plain:
            return DeviceTokens(logits.argmax(dim=-1), [None] * len(requests))
        params = [r.sampling_params for r in requests]
        ks = [p.logprobs for p in params]
        if all(plain_greedy(r) for r in requests):
            ids = logits.argmax(dim=-1)  # the common greedy step: no parameter table
            return DeviceTokens(ids, ks, _pack(logits, ids, ks))
        if any(r.grammar is not None for r in requests):  # structured outputs, first of all
            apply_grammar_masks(logits, requests)
        penalties = any(has_penalty(p) for p in params)
        edits = self._logit_edits(requests)
        processed = logits
        if any(has_token_masks(r) for r in requests):  # a copy: logprobs stay raw
            processed = apply_token_masks(logits, requests, pending, self._to_device)
        if not penalties and edits is None and all(p.greedy for p in params):
            ids = processed.argmax(dim=-1)
            return DeviceTokens(ids, ks, _pack(logits, ids, ks))
        rows = self._rows(requests, logits.shape[1])
        if edits is not None:  # logit_bias, min_tokens: before penalties, as vLLM
            processed = processed.index_put((edits[0], edits[1]), edits[2], accumulate=True)
        if penalties:
            tokens = self._history(requests, logits.shape[1], pending)
            processed = apply_penalties(processed, tokens, rows.prompt_len, rows.presence,
                                        rows.frequency, rows.repetition)
        if all(not p.greedy for p in params):
            ids = self._sample(processed, params, rows)
        else:
            ids = processed.argmax(dim=-1)
            if not all(p.greedy for p in params):
                sampled = self._sample(processed, params, rows)
                ids = torch.where(rows.temperature == 0, ids, sampled)
        return DeviceTokens(ids, ks, _pack(logits, ids, ks))

    def _rows(self, requests: Sequence[Request], vocab: int) -> _Rows:
        # Each row: its request's fixed columns (made once, kept on the request) and the
        # position of the token to sample.
        table = [(*self._fixed_row(r, vocab), r.num_tokens_with_placeholders)
                 for r in requests]
        # float64 holds every column exactly (ints < 2**53), so one copy carries them all
        # (numpy reads the tuples faster than torch.tensor). The seed's halves and the
        # position become the noise's two keys.
        a = np.array(table, dtype=np.float64)
        seeds = a[:, 3].astype(np.uint64) | (a[:, 4].astype(np.uint64) << np.uint64(32))
        a[:, 3], a[:, 4] = row_keys(seeds, a[:, 10].astype(np.int64))
        t = self._to_device(torch.from_numpy(np.ascontiguousarray(a[:, :10])))  # pinnable
        ints, floats = t.to(torch.int64), t.to(torch.float32)
        return _Rows(temperature=floats[:, 0], top_k=ints[:, 1], top_p=floats[:, 2],
                     key1=ints[:, 3], key2=ints[:, 4], presence=floats[:, 5],
                     frequency=floats[:, 6], repetition=floats[:, 7], prompt_len=ints[:, 8],
                     min_p=floats[:, 9])

    def _fixed_row(self, r: Request, vocab: int) -> tuple[float, ...]:
        """`r`'s sampling columns that do not change from step to step (its
        `sample_row`, made on its first sampled step with these params)."""
        p = r.sampling_params
        if r.sample_row is not None and r.sample_row[0] is p and r.sample_row[1] == vocab:
            return r.sample_row[2]
        seed = 0 if p.greedy else self._seed(r)
        # Only the repetition penalty looks at the prompt; else the history is output.
        plen = r.num_prompt_tokens if p.repetition_penalty != 1.0 else 0
        row = (p.temperature, min(p.top_k or vocab, vocab), p.top_p, seed & _M32, seed >> 32,
               p.presence_penalty, p.frequency_penalty, p.repetition_penalty, plen, p.min_p)
        r.sample_row = (p, vocab, row)
        return row

    def _logit_edits(self, requests: Sequence[Request],
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(rows, token ids, values) to add to the logits: each row's logit_bias, and -inf
        on EOS and stop tokens while a row has fewer than min_tokens outputs. One copy."""
        table: list[tuple[int, int, float]] = []
        for i, r in enumerate(requests):
            p = r.sampling_params
            if not p.logit_bias and not p.min_tokens:
                continue  # most requests: nothing to edit
            table += [(i, t, b) for t, b in p.logit_bias.items()]
            if r.num_output_tokens + r.num_output_placeholders < p.min_tokens:
                table += [(i, t, float("-inf"))
                          for t in {*r.eos_token_ids, *p.stop_token_ids}]
        if not table:
            return None
        t = self._to_device(torch.tensor(table, dtype=torch.float64))
        return t[:, 0].long(), t[:, 1].long(), t[:, 2].float()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """One host->device copy. On CUDA from pinned memory and non-blocking: a copy
        from pageable memory would first wait for the forward pass still queued."""
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _seed(self, req: Request) -> int:
        """The request's seed, or one drawn once for an unseeded request and kept on it
        (a preempted and recomputed request then redraws the same tokens)."""
        if req.sampling_params.seed is not None:
            return req.sampling_params.seed
        if req.sample_seed is None:
            req.sample_seed = self._seeds.getrandbits(63)
        return req.sample_seed

    def _history(self, requests: Sequence[Request], vocab: int,
                 pending: PendingIds | None = None) -> torch.Tensor:
        """[B, L] int64 on the device: prompt + output ids of rows with a repetition
        penalty, output ids of rows with only presence/frequency, padded with `vocab`.
        A penalised row's placeholder token (async scheduling) is copied in on the
        device from `pending`: the host writes `vocab + 1 + its row` in its slot."""
        hist: list[list[int]] = []
        filled = False
        for r in requests:
            p = r.sampling_params
            if p.repetition_penalty != 1.0:
                h = r.all_token_ids
            else:
                h = r.output_token_ids if has_penalty(p) else []
            if r.num_output_placeholders and has_penalty(p):
                if pending is None or r.request_id not in pending.rows:
                    raise RuntimeError(f"request {r.request_id} has a placeholder token "
                                       "but no step in flight holds it")
                h = [*h, vocab + 1 + pending.rows[r.request_id]]
                filled = True
            hist.append(h)
        out = torch.full((len(hist), max(map(len, hist))), vocab, dtype=torch.int64)
        for i, h in enumerate(hist):
            out[i, :len(h)] = torch.as_tensor(h, dtype=torch.int64)
        out = self._to_device(out)
        if filled:
            assert pending is not None
            slot = out > vocab
            rows = (out - (vocab + 1)).clamp_(min=0, max=pending.ids.numel() - 1)
            out = torch.where(slot, pending.ids[rows], out)
        return out

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], rows: _Rows,
                ) -> torch.Tensor:
        """The exponential race (`gumbel_race`) over the temperature-scaled logits, after
        min-p, top-k and top-p. Greedy rows get a placeholder temperature of 1 and are
        overridden by the caller."""
        temps = torch.where(rows.temperature == 0, 1.0, rows.temperature)
        filters = any(p.min_p > 0.0 for p in params)
        top = any(p.top_k is not None or p.top_p < 1.0 for p in params)
        if filters or top:  # the filters see the scaled logits: the race divides no more
            logits = logits / temps.unsqueeze(1)
            temps = torch.ones_like(temps)
            if filters:  # after temperature, before top-k/p: vLLM's order
                logits = min_p_filter(logits, rows.min_p)
            if top:
                logits = top_k_top_p(logits, rows.top_k, rows.top_p)
        return self._race(logits, temps, rows.key1, rows.key2)


class DeviceTokens:
    """A batch's sampled ids (and logprobs) on the device. `to_host` starts their copy
    to the host without waiting (CUDA: pinned memory, an event after it); `result`
    waits for it and returns them as `Sampler.__call__` does."""

    def __init__(self, ids: torch.Tensor, ks: list[int | None],
                 packed: torch.Tensor | None = None) -> None:
        self.ids = ids  # [B] int64 on the device: the next step's inputs can read them
        self.ks = ks
        self._src = packed if packed is not None else ids
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def to_host(self) -> None:
        if self._host is not None:
            return
        if self._src.is_cuda:
            self._host = torch.empty(self._src.shape, dtype=self._src.dtype, pin_memory=True)
            self._host.copy_(self._src, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = self._src.cpu()

    def host_ids(self) -> np.ndarray:
        """The sampled ids on the host, int64 [B] (after `result`)."""
        assert self._host is not None
        if self._src is self.ids:
            return self._host.numpy()
        return self._host[:, 0].numpy().astype(np.int64)

    def result(self) -> tuple[list[int], list[Logprobs | None]]:
        self.to_host()
        assert self._host is not None
        if self._copied is not None:
            self._copied.synchronize()
        if self._src is self.ids:
            return self._host.tolist(), [None] * len(self.ks)
        return _unpack(self._host.tolist(), self.ks)


def _pack(logits: torch.Tensor, ids: torch.Tensor, ks: Sequence[int | None],
          ) -> torch.Tensor | None:
    """Ids, the sampled token's logprob and the top-n (ids, values) of every row in one
    float64 tensor (exact for ids and float32 values), for one copy back; None when no
    row asked for logprobs."""
    n = max((k for k in ks if k is not None), default=None)
    if n is None:
        return None
    logp = logits.log_softmax(dim=-1)
    top = logp.topk(n, dim=-1)
    return torch.cat([ids.unsqueeze(1).double(), logp.gather(1, ids.unsqueeze(1)).double(),
                      top.indices.double(), top.values.double()], dim=1)


def _unpack(packed: list[list[float]], ks: Sequence[int | None],
            ) -> tuple[list[int], list[Logprobs | None]]:
    n = max((k for k in ks if k is not None), default=0)
    tokens: list[int] = []
    lps: list[Logprobs | None] = []
    for k, row in zip(ks, packed, strict=True):
        tok = int(row[0])
        tokens.append(tok)
        if k is None:
            lps.append(None)
            continue
        top_ids, top_vals = row[2:2 + k], row[2 + n:2 + n + k]
        lps.append({tok: row[1]} | {int(i): v for i, v in zip(top_ids, top_vals, strict=True)})
    return tokens, lps


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, ks: Sequence[int | None],
                   ) -> tuple[list[int], list[Logprobs | None]]:
    """(ids as ints, and per row b with ks[b] not None: {ids[b]: its logprob} followed
    by the ks[b] most likely tokens, best first: vLLM's order, where a chosen token
    among them keeps the first place). Log-softmax of `logits` [B, V] as given; the
    results travel in one float64 tensor (exact for ids and float32 values): one copy."""
    packed = _pack(logits, ids, ks)
    if packed is None:
        return ids.cpu().tolist(), [None] * len(ks)
    return _unpack(packed.cpu().tolist(), ks)
