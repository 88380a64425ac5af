"""Simulated workloads: what arrives when, how long its prompt and answer are, and which
prompts share which prefixes, without materializing token ids (a Mooncake prompt is
~12k tokens; a million of them do not fit in memory as lists).

A prompt is a chain of segments `(key, tokens)`: two prompts whose first k segments
have equal keys share those tokens, exactly as bench/datasets.py builds token ids (a
Mooncake hash id -> one block of tokens derived from the id; a shared-prefix group ->
one system prompt). `BlockHasher` turns segments into the engine's per-block prefix
identities: block j's hash names the prefix up to its last token, so equal prefixes
give equal hashes and anything else differs, the property engine/block_hash.py gives
real tokens. Hashes are ints (dict keys in the block pool and the index; nothing leaves
the process): `chain << SEGMENT_SHIFT | block's number in the segment`, so a segment's
blocks are consecutive ints, which the in-process index keeps as one bitmap per node
(sim/index.py, sim/segments.py). A segment longer than 2**SEGMENT_SHIFT blocks is numbered in parts,
each part a chain of its own.

Sources: `from_bench` (any bench dataset and load shape, token ids as one-token
segments: the validation path), `mooncake` (the trace, streamed, with bench's length
arithmetic), `synthetic` (Poisson or bursty arrivals), `shared_prefix`.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from sys import getrefcount
from typing import Final

from bench.base import BenchError, BenchRequest
from bench.datasets import (
    MOONCAKE_BLOCK_TOKENS,
    LengthDist,
    mooncake_records,
    scaled_output_len,
)
from bench.load import LoadSpec, start_offsets, units
from sim.segments import SEGMENT_SHIFT

_PART: Final = 1 << SEGMENT_SHIFT  # blocks a segment (or part of one) numbers
_NEXT_PART: Final = -1  # the chain key of a segment's next part (content keys are >= 0)
_PROBES: Final = 4  # named chains a new one looks at for recycling before more are made
_BATCH: Final = 4096  # chains made at once
_FIRST: Final = 1 + (256 >> SEGMENT_SHIFT)  # the first chain id: its ints are > 256
_UNSHARED: Final = -1  # a chain's epoch when no epoch's `_chains` names it


@dataclass(frozen=True, slots=True)
class SimRequestSpec:
    arrival_s: float
    prompt_len: int
    output_len: int
    segments: tuple[tuple[int, int], ...]  # (content key, tokens); cover >= prompt_len
    tag: str = ""
    # Specs arrive in epoch order, and no content key of an epoch recurs in a later one
    # (the trace replayed again with fresh hash ids): BlockHasher forgets an epoch's
    # prefixes once the next starts, so a million requests do not keep them all.
    epoch: int = 0


class BlockHasher:
    """Prefix identities of full blocks. `chain` ids are shared by every request of a
    run (one per distinct prefix of segments); a `salt` starts a separate chain root
    (bench's per-phase cache_salt).

    The hashes' int objects are made once per chain and kept for the run (`_slabs`):
    chain c's blocks are the same objects every time, for every request (a prefix map's
    key is then the very object looked up, found by identity). They are made in batches
    of chains, next to each other in memory, and never freed: a chain id is named again
    (recycled, with its ints) once nothing but the hasher holds them (no pool, tier,
    index batch, event, window or request: their references are what counts) and no
    prefix of this epoch names it (`_chains`). Made per new prefix and freed as the
    pools evict them, as they were before, the ints came from wherever the allocator
    had a hole, further apart as a run aged, and every pass over a prompt's hashes (the
    pools' probes, the index's runs, the events) missed the caches per int. Memory: about
    twice the chains the pools hold (1.04 M chains, 33 M ints at 200,000 requests).
    `recycle=False` names every chain anew and keeps them all (for tests and short runs:
    what the tests hold recycling runs to)."""

    def __init__(self, block_size: int, recycle: bool = True, batch: int = _BATCH) -> None:
        if block_size < 1 or batch < 1:
            raise ValueError(f"need block_size >= 1 and batch >= 1, got {block_size}, {batch}")
        self.block_size = block_size
        self.recycle = recycle
        self.batch = batch  # chains made at once
        self._chains: dict[tuple[int, int], int] = {}  # (parent chain, key) -> chain
        # chain -> its blocks' hashes (chain << SEGMENT_SHIFT | i); the first chains'
        # would be CPython's shared small ints: not used
        self._slabs: list[tuple[int, ...]] = [()] * _FIRST
        self._named: list[int] = [_UNSHARED] * _FIRST  # chain -> the epoch it was named in
        self._ring: deque[int] = deque()  # the chains named, the least recently first
        self._unnamed: deque[int] = deque()  # the chains made and never named, in order
        self._width = 1  # the ints a chain is made with: the most one has needed
        self._epoch = 0
        self.recycled = 0  # chains named again
        # what `_held` counts for an int the slab alone holds
        self._free_refs = sum(map(getrefcount, tuple(range(1 << 40, (1 << 40) + 1))))

    def _held(self, slab: tuple[int, ...]) -> bool:
        """Whether anything but the slab holds one of its ints (the same expression as
        `_free_refs`'s: an int's count there is the slab's reference and map's)."""
        return sum(map(getrefcount, slab)) != self._free_refs * len(slab)

    def _new_chain(self, shared: bool) -> int:
        """A chain id no live hash uses: one made and never named, else the least
        recently named one whose ints nothing but the hasher holds and that was not
        named in this epoch (of the first `_PROBES`; held ones go to the back), else
        one of `batch` made now. `shared`: named in `_chains` (a prefix others may
        reach again in this epoch)."""
        named, ring = self._named, self._ring
        if not self._unnamed:
            if self.recycle:
                for _ in range(min(len(ring), _PROBES)):
                    c = ring.popleft()
                    ring.append(c)  # named now, or looked at again after the others
                    if named[c] != self._epoch and not self._held(self._slabs[c]):
                        named[c] = self._epoch if shared else _UNSHARED
                        self.recycled += 1
                        return c
            self._make()
        c = self._unnamed.popleft()
        named[c] = self._epoch if shared else _UNSHARED
        if self.recycle:
            ring.append(c)
        return c

    def _make(self) -> None:
        """`batch` chains more, their ints made in one go (next to each other)."""
        w = self._width
        first = len(self._slabs)
        for c in range(first, first + self.batch):
            base = c << SEGMENT_SHIFT
            self._slabs.append(tuple(range(base, base + w)))
            self._named.append(_UNSHARED)
        self._unnamed.extend(range(first, first + self.batch))

    def _slab(self, chain: int, m: int) -> tuple[int, ...]:
        """`chain`'s first `m` hashes (made now if the chain never had that many)."""
        got = self._slabs[chain]
        if len(got) < m:
            base = chain << SEGMENT_SHIFT
            got = self._slabs[chain] = got + tuple(range(base + len(got), base + m))
            self._width = max(self._width, m)  # the chains made next have as many
        return got if len(got) == m else got[:m]

    def _chain(self, parent: int, key: int) -> int:
        k = (parent, key)
        c = self._chains.get(k)
        if c is None:
            c = self._chains[k] = self._new_chain(True)
        return c

    def _enter(self, epoch: int) -> None:
        """A spec of `epoch` arrives: an earlier epoch's prefixes are never seen again."""
        if epoch < self._epoch:
            raise ValueError(f"a spec of epoch {epoch} after epoch {self._epoch}: the "
                             "hasher has forgotten its prefixes (specs go in epoch order)")
        self._chains.clear()
        self._epoch = epoch

    def hashes(self, spec: SimRequestSpec, total_len: int, salt: int = 0) -> list[int]:
        """One hash per full block of `total_len` tokens (prompt + output). A block of
        prompt tokens is named by the chain of the segment holding its last token and
        its number among the blocks ending in that segment (one range per segment).
        Blocks of sampled tokens are never shared: a chain of their own per call."""
        if spec.epoch != self._epoch:
            self._enter(spec.epoch)
        bs = self.block_size
        n_full = total_len // bs
        n_shared = min(n_full, spec.prompt_len // bs)  # the rest hold sampled tokens
        last = n_shared * bs
        out: list[int] = []
        chains, slabs = self._chains, self._slabs
        chain, start = -1 - salt, 0
        for key, n in spec.segments:
            if start >= last:
                break
            c = chains.get((chain, key))  # `_chain`, inlined: once per segment
            chain = c if c is not None else self._chain(chain, key)
            first, stop = (start // bs + 1) * bs, min(start + n, last)  # block ends here
            count = (stop - first) // bs + 1 if stop >= first else 0
            start += n
            if count == 1:  # a segment of one block (the trace's at its own block
                out.append(slabs[chain][0])  # size): a chain's first int, never unmade
                continue
            part = chain  # a segment's blocks past the first 2**SEGMENT_SHIFT: a part
            while count > 0:  # chained on the one before
                m = min(_PART, count)
                out.extend(self._slab(part, m))
                count -= m
                if count:
                    part = self._chain(part, _NEXT_PART)
        left = n_full - n_shared
        while left > 0:  # sampled blocks: a chain of their own, shared by nothing
            out.extend(self._slab(self._new_chain(False), min(_PART, left)))
            left -= _PART
        return out


def from_bench(requests: Sequence[BenchRequest], load: LoadSpec) -> list[SimRequestSpec]:
    """Bench requests under an open-loop load shape (bench/load.py's own offsets);
    token-id prompts keep their exact sharing, text prompts share nothing."""
    work = units(list(requests))
    offsets = start_offsets(load, work)
    if offsets is None:
        raise BenchError("the simulator replays open-loop loads (poisson, constant, trace)")
    out = []
    for t, unit in zip(offsets, work, strict=True):
        for r in unit:  # session turns arrive together (no closed loop in the simulator)
            segs = tuple((int(x), 1) for x in r.prompt) if isinstance(r.prompt, tuple) \
                else ((_text_key(r.prompt), r.prompt_len),)
            out.append(SimRequestSpec(t, r.prompt_len, r.output_len, segs, r.tag))
    out.sort(key=lambda s: s.arrival_s)
    return out


def _text_key(text: str) -> int:
    import zlib

    return zlib.crc32(text.encode()) | (1 << 40)


def trace_prompt_len(n_hashes: int, n_in: int, block_tokens: int) -> tuple[int, int]:
    """(prompt tokens, tokens of the last hash id's block): bench/datasets.py's
    `_trace_prompt` arithmetic (a partial last block is a prefix of its full block)."""
    last_fill = n_in - MOONCAKE_BLOCK_TOKENS * (n_hashes - 1)
    last_fill = min(max(last_fill, 1), MOONCAKE_BLOCK_TOKENS)
    last_len = max(1, math.ceil(last_fill * block_tokens / MOONCAKE_BLOCK_TOKENS))
    return block_tokens * (n_hashes - 1) + last_len, last_len


def mooncake(path: str, limit: int | None = None, block_tokens: int = MOONCAKE_BLOCK_TOKENS,
             time_scale: float = 1.0, output_scale: float = 1.0,
             max_output_len: int | None = None, max_input_len: int | None = None,
             repeat: int = 1) -> Iterator[SimRequestSpec]:
    """The Mooncake JSONL as bench.datasets.mooncake reads it (same lengths, arrivals
    `timestamp / 1000 * time_scale`), streamed. `repeat` > 1 replays the trace again
    after its end with fresh hash ids (new conversations, same shape), for runs longer
    than the trace; 0: as often as `limit` needs. `limit` caps the total."""
    if block_tokens < 1 or time_scale < 0 or output_scale <= 0 or repeat < 0 \
            or (repeat == 0 and limit is None):
        raise BenchError("need block_tokens >= 1, time_scale >= 0, output_scale > 0, "
                         "repeat >= 0 (0 only with a limit)")
    kept: list[tuple[float, int, int, list[int]]] = []  # the replays read the first's

    def first() -> Iterator[tuple[float, int, int, list[int]]]:
        t0: float | None = None
        for rec in mooncake_records(path):
            n_prompt, _ = trace_prompt_len(len(rec.hash_ids), rec.input_length, block_tokens)
            if max_input_len is not None:
                n_prompt = min(n_prompt, max_input_len)
            n_out = scaled_output_len(rec.output_length, output_scale, max_output_len)
            t0 = rec.timestamp_ms if t0 is None else t0
            item = ((rec.timestamp_ms - t0) / 1000.0 * time_scale, n_prompt, n_out,
                    rec.hash_ids)
            if repeat != 1:
                kept.append(item)
            yield item

    n = 0
    span = 0.0
    for k in itertools.count() if repeat == 0 else range(repeat):
        if k and n == 0:
            raise BenchError(f"{path}: no usable records")
        last = 0.0
        fresh = k << 40  # this replay's hash ids
        for last, n_prompt, n_out, ids in first() if k == 0 else kept:
            if limit is not None and n >= limit:
                return
            segs = tuple(zip(map(fresh.__or__, ids), itertools.repeat(block_tokens)))
            n += 1
            yield SimRequestSpec(span + last, n_prompt, n_out, segs, "trace", k)
        span += last


def trace_rate(path: str, limit: int | None = None) -> float:
    """Requests per second of trace time over the first `limit` records (the rate a
    time scale of 1 replays them at)."""
    first = last = None
    n = 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            ts = float(json.loads(line)["timestamp"]) / 1000.0
            first = ts if first is None else first
            last = ts
            n += 1
            if limit is not None and n >= limit:
                break
    if first is None or last is None or last <= first:
        raise BenchError(f"{path}: needs records spanning some time")
    return (n - 1) / (last - first)


def arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """`n` arrival times at mean `rate`/s: Poisson (burstiness 1), or gamma gaps whose
    coefficient of variation is `burstiness` (> 1: bursts and lulls)."""
    if not rate > 0 or not burstiness > 0:
        raise BenchError("need rate > 0 and burstiness > 0")
    if burstiness == 1.0:
        return start_offsets(LoadSpec("poisson", rate=rate, seed=seed), [[]] * n) or []
    rng = random.Random(seed)
    shape = 1.0 / burstiness**2
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
    return out


def synthetic(n: int, rate: float, input_len: LengthDist, output_len: LengthDist,
              burstiness: float = 1.0, seed: int = 0) -> list[SimRequestSpec]:
    """Unshared prompts (each its own content) arriving at `rate`."""
    rng = random.Random(seed)
    out = []
    for i, t in enumerate(arrivals(n, rate, burstiness, seed)):
        p = input_len.sample(rng)
        out.append(SimRequestSpec(t, p, output_len.sample(rng), (((1 << 41) | i, p),),
                                  "synthetic"))
    return out


def shared_prefix(num_groups: int, per_group: int, prefix_len: int, suffix_len: int,
                  output_len: int, rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> list[SimRequestSpec]:
    """bench.datasets.shared_prefix's shape (groups interleaved) arriving at `rate`."""
    if min(num_groups, per_group, prefix_len, suffix_len) < 1:
        raise BenchError("shared-prefix needs groups, per-group, prefix and suffix >= 1")
    times = arrivals(num_groups * per_group, rate, burstiness, seed)
    out = []
    for i, t in enumerate(times):
        g = i % num_groups
        segs = (((1 << 42) | g, prefix_len), ((1 << 43) | i, suffix_len))
        out.append(SimRequestSpec(t, prefix_len + suffix_len, output_len, segs, f"group{g}"))
    return out
