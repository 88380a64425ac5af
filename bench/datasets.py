"""Workloads: synthetic lengths, shared-prefix groups, ShareGPT JSON, Mooncake JSONL
traces and multi-turn sessions, each a list of `BenchRequest`s (deterministic per seed).

Token-id prompts are drawn from `TokenPool`: ids of the model's tokenizer that are not
special and decode/encode back to themselves, so a token-id prompt is something the
model's own tokenizer could have produced.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from bench.base import BenchError, BenchRequest

MOONCAKE_BLOCK_TOKENS = 512  # one Mooncake hash id stands for 512 prompt tokens


class TokenPool:
    """Token ids to build prompts from. `block(key, n)` is deterministic in `key`, so
    equal keys give equal token blocks (shared prefixes, trace hash ids)."""

    def __init__(self, ids: list[int], seed: int = 0) -> None:
        if len(ids) < 2:
            raise BenchError("the token pool needs at least two token ids")
        self.ids = ids
        self.seed = seed

    @classmethod
    def from_tokenizer_dir(cls, model_dir: str, seed: int = 0) -> TokenPool:
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
        except Exception as e:
            raise BenchError(f"cannot read {model_dir}/tokenizer.json: {e}") from e
        special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        ids = []
        for i in range(tok.get_vocab_size()):
            piece = tok.id_to_token(i)
            if piece is None or piece in special:
                continue
            text = tok.decode([i])
            if text.strip() and tok.encode(text, add_special_tokens=False).ids == [i]:
                ids.append(i)
        return cls(ids, seed)

    def random(self, rng: random.Random, n: int) -> tuple[int, ...]:
        return tuple(rng.choice(self.ids) for _ in range(n))

    def block(self, key: str | int, n: int) -> tuple[int, ...]:
        return self.random(random.Random(f"{self.seed}:{key}"), n)


@dataclass(frozen=True, slots=True)
class LengthDist:
    """constant: `mean`; normal: N(mean, spread) rounded; uniform: mean +- spread.
    Always clipped to [lo, hi]."""

    kind: str = "constant"
    mean: int = 128
    spread: float = 0.0
    lo: int = 1
    hi: int = 1 << 20

    def __post_init__(self) -> None:
        if self.kind not in ("constant", "normal", "uniform"):
            raise BenchError(f"length distribution must be constant, normal or uniform, "
                             f"got {self.kind!r}")
        if self.mean < 1 or self.spread < 0 or not 1 <= self.lo <= self.hi:
            raise BenchError("lengths need mean >= 1, spread >= 0 and 1 <= lo <= hi")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "normal":
            n = round(rng.gauss(self.mean, self.spread))
        elif self.kind == "uniform":
            n = rng.randint(round(self.mean - self.spread), round(self.mean + self.spread))
        else:
            n = self.mean
        return max(self.lo, min(self.hi, n))


def synthetic(pool: TokenPool, n: int, input_len: LengthDist, output_len: LengthDist,
              seed: int = 0, tag: str = "") -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = pool.random(rng, input_len.sample(rng))
        out.append(BenchRequest(ids, len(ids), output_len.sample(rng), tag=tag))
    return out


def shared_prefix(pool: TokenPool, num_groups: int, per_group: int, prefix_len: int,
                  suffix_len: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """`num_groups` system prompts of `prefix_len` tokens, each followed by `per_group`
    distinct suffixes; groups are interleaved (g0, g1, ..., g0, g1, ...)."""
    if min(num_groups, per_group, prefix_len, suffix_len) < 1:
        raise BenchError("shared-prefix needs groups, per-group, prefix and suffix >= 1")
    rng = random.Random(seed)
    prefixes = [pool.block(f"prefix-{seed}-{g}", prefix_len) for g in range(num_groups)]
    out = []
    for _ in range(per_group):
        for g, prefix in enumerate(prefixes):
            ids = prefix + pool.random(rng, suffix_len)
            out.append(BenchRequest(ids, len(ids), output_len, tag=f"group{g}"))
    return out


@dataclass(frozen=True, slots=True)
class MooncakeRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def mooncake_records(path: str) -> Iterator[MooncakeRecord]:
    """The usable records of a Mooncake JSONL, in order (blank lines and records with no
    prompt skipped); a malformed line raises BenchError naming it. The bench and the
    simulator (sim/workload.py) read traces through this one parser."""
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                r = MooncakeRecord(float(rec["timestamp"]), int(rec["input_length"]),
                                   int(rec["output_length"]),
                                   [int(h) for h in rec["hash_ids"]])
            except (ValueError, KeyError, TypeError) as e:
                raise BenchError(f"{path}:{lineno}: not a Mooncake record ({e})") from e
            if r.hash_ids and r.input_length >= 1:
                yield r


def scaled_output_len(n_out: int, output_scale: float, max_output_len: int | None) -> int:
    n = max(1, round(n_out * output_scale))
    return n if max_output_len is None else min(n, max_output_len)


def mooncake(path: str, pool: TokenPool, limit: int | None = None,
             block_tokens: int = MOONCAKE_BLOCK_TOKENS, time_scale: float = 1.0,
             output_scale: float = 1.0, max_output_len: int | None = None,
             max_input_len: int | None = None) -> list[BenchRequest]:
    """Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`, one
    id per 512-token block). Each id becomes `block_tokens` tokens (equal ids -> equal
    blocks); the last block keeps the trace's partial fill, scaled. Arrival offsets are
    `timestamp / 1000 * time_scale` seconds from the first record."""
    if block_tokens < 1 or time_scale < 0 or output_scale <= 0:
        raise BenchError("need block_tokens >= 1, time_scale >= 0 and output_scale > 0")
    out: list[BenchRequest] = []
    t0: float | None = None
    for rec in mooncake_records(path):
        if limit is not None and len(out) >= limit:
            break
        ids = _trace_prompt(pool, rec.hash_ids, rec.input_length, block_tokens)
        if max_input_len is not None:
            ids = ids[:max_input_len]
        n_out = scaled_output_len(rec.output_length, output_scale, max_output_len)
        t0 = rec.timestamp_ms if t0 is None else t0
        out.append(BenchRequest(ids, len(ids), n_out, arrival_s=(rec.timestamp_ms - t0)
                                / 1000.0 * time_scale, tag="trace"))
    if not out:
        raise BenchError(f"{path}: no usable records")
    return out


def _trace_prompt(pool: TokenPool, hashes: list[int], n_in: int,
                  block_tokens: int) -> tuple[int, ...]:
    last_fill = n_in - MOONCAKE_BLOCK_TOKENS * (len(hashes) - 1)
    last_fill = min(max(last_fill, 1), MOONCAKE_BLOCK_TOKENS)
    last_len = max(1, math.ceil(last_fill * block_tokens / MOONCAKE_BLOCK_TOKENS))
    ids: tuple[int, ...] = ()
    for i, h in enumerate(hashes):
        block = pool.block(f"mooncake-{h}", block_tokens)
        # A partial last block is a prefix of the full block its id stands for.
        ids += block[:last_len] if i == len(hashes) - 1 else block
    return ids


def sharegpt(path: str, count_tokens: TokenCounter, limit: int | None = None,
             multi_turn: bool = False, max_input_len: int | None = None,
             max_output_len: int | None = None) -> list[BenchRequest]:
    """ShareGPT JSON: a list of {"conversations": [{"from": "human"|"gpt", "value"}]}.
    Text prompts; the output length is the recorded answer's token count. With
    `multi_turn`, turn k's prompt is the conversation so far (recorded answers as
    history) and the turns of one conversation run in order as one session."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot read ShareGPT file {path}: {e}") from e
    if not isinstance(data, list):
        raise BenchError(f"{path}: expected a JSON list of conversations")
    out: list[BenchRequest] = []
    for ci, conv in enumerate(data):
        if limit is not None and len(out) >= limit:
            break
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            continue
        history = ""
        pairs = list(zip(turns[0::2], turns[1::2], strict=False))
        for k, (q, a) in enumerate(pairs if multi_turn else pairs[:1]):
            if not (isinstance(q, dict) and isinstance(a, dict)) or q.get("from") != "human":
                break
            prompt = history + str(q.get("value", ""))
            n_in, n_out = count_tokens(prompt), count_tokens(str(a.get("value", "")))
            if n_in < 1 or n_out < 1 or (max_input_len and n_in > max_input_len):
                break
            if max_output_len:
                n_out = min(n_out, max_output_len)
            out.append(BenchRequest(prompt, n_in, n_out, session=f"conv{ci}"
                                    if multi_turn else None, turn=k, tag="sharegpt"))
            history = prompt + "\n" + str(a.get("value", "")) + "\n"
    if not out:
        raise BenchError(f"{path}: no usable conversations")
    return out


def multi_turn(pool: TokenPool, num_sessions: int, turns: int, user_len: int,
               answer_len: int, seed: int = 0) -> list[BenchRequest]:
    """Synthetic chat sessions: turn k sends the whole history (k earlier user messages
    and answers of `answer_len` tokens) plus a new user message; a session's turns run
    in order, so the history is a prefix the server can cache."""
    if min(num_sessions, turns, user_len, answer_len) < 1:
        raise BenchError("multi-turn needs sessions, turns and lengths >= 1")
    rng = random.Random(seed)
    out = []
    for s in range(num_sessions):
        history: tuple[int, ...] = ()
        for k in range(turns):
            ids = history + pool.random(rng, user_len)
            out.append(BenchRequest(ids, len(ids), answer_len, session=f"s{s}", turn=k,
                                    tag=f"turn{k}"))
            history = ids + pool.random(rng, answer_len)
    return out


class TokenCounter:
    """Counts tokens of text with a model's tokenizer (ShareGPT lengths)."""

    def __init__(self, model_dir: str) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")

    def __call__(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)
