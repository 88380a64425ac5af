"""Simulated workloads read the trace as bench does, and their block hashes share
exactly what the token ids bench would send share."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.datasets import TokenPool
from bench.datasets import mooncake as bench_mooncake
from bench.load import LoadSpec
from sim.index import InProcessBlockIndex
from sim.workload import BlockHasher, from_bench, mooncake, trace_rate

RECORDS = [
    {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [7, 8]},
    {"timestamp": 250, "input_length": 1100, "output_length": 9, "hash_ids": [7, 8, 9]},
    {"timestamp": 400, "input_length": 300, "output_length": 2, "hash_ids": [7]},
    {"timestamp": 900, "input_length": 1536, "output_length": 4, "hash_ids": [7, 10, 11]},
    {"timestamp": 1000, "input_length": 1025, "output_length": 3, "hash_ids": [7, 8, 9]},
]


def write(tmp_path: Path) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return str(path)


def shared_blocks(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_mooncake_matches_the_bench_loader(tmp_path: Path) -> None:
    path = write(tmp_path)
    pool = TokenPool(list(range(10, 500)), seed=3)
    bench = bench_mooncake(path, pool, block_tokens=32, time_scale=0.5, max_input_len=80)
    sim = list(mooncake(path, block_tokens=32, time_scale=0.5, max_input_len=80))
    assert [(s.prompt_len, s.output_len, s.arrival_s) for s in sim] == \
        [(b.prompt_len, b.output_len, b.arrival_s) for b in bench]
    # Block hashes from the trace's segments share exactly the blocks bench's token ids
    # share, pair by pair (the prefix-cache and index behaviour follows).
    exact = from_bench(bench, LoadSpec("trace"))
    h_seg, h_tok = BlockHasher(16), BlockHasher(16)
    seg = [h_seg.hashes(s, s.prompt_len) for s in sim]
    tok = [h_tok.hashes(s, s.prompt_len) for s in exact]
    assert [len(h) for h in seg] == [len(h) for h in tok]
    for i in range(len(sim)):
        for j in range(len(sim)):
            assert shared_blocks(seg[i], seg[j]) == shared_blocks(tok[i], tok[j]), (i, j)
    assert trace_rate(path) == 4 / 1.0


def test_segments_longer_than_a_part_share_what_token_ids_share(tmp_path: Path) -> None:
    """A trace hash id of 512 tokens at 4-token blocks is 128 blocks, numbered in parts of
    2**SEGMENT_SHIFT (sim/index.py): sharing is still exactly the token ids', each part
    is a run of consecutive ints, and sampled blocks past a part are shared by nothing."""
    from sim.index import SEGMENT_SHIFT

    path = write(tmp_path)
    pool = TokenPool(list(range(10, 500)), seed=3)
    bench = bench_mooncake(path, pool, block_tokens=512)
    sim = list(mooncake(path, block_tokens=512))
    h_seg, h_tok = BlockHasher(4), BlockHasher(4)
    seg = [h_seg.hashes(s, s.prompt_len + 40 * 4) for s in sim]  # 40 sampled blocks each
    tok = [h_tok.hashes(s, s.prompt_len + 40 * 4)
           for s in from_bench(bench, LoadSpec("trace"))]
    assert max(s.prompt_len for s in sim) // 4 > 3 << SEGMENT_SHIFT
    for i in range(len(sim)):
        assert len(set(seg[i])) == len(seg[i])
        for j in range(len(sim)):
            assert shared_blocks(seg[i], seg[j]) == shared_blocks(tok[i], tok[j]), (i, j)
    sampled = [set(h[s.prompt_len // 4:]) for h, s in zip(seg, sim, strict=True)]
    every = [x for h in seg for x in h]
    assert all(every.count(x) == 1 for part in sampled for x in part)
    part = seg[3][:1 << SEGMENT_SHIFT]  # the first part of a prompt: consecutive ints
    assert part == list(range(part[0], part[0] + len(part)))


def test_repeat_replays_with_fresh_conversations(tmp_path: Path) -> None:
    path = write(tmp_path)
    specs = list(mooncake(path, block_tokens=16, limit=12, repeat=0))
    assert len(specs) == 12 and specs[5].arrival_s == specs[4].arrival_s
    h = BlockHasher(16)
    first, again = h.hashes(specs[0], 32), h.hashes(specs[5], 32)
    assert first and not set(first) & set(again)  # the second pass shares nothing


def test_hasher_forgets_an_epoch_once_the_next_starts(tmp_path: Path) -> None:
    """A replay's prefixes are dropped when the next replay starts (bounded memory on a
    million requests); within an epoch prefixes still share, chain ids are never reused,
    and a spec of an earlier epoch afterwards is an error, not a silent miss."""
    path = write(tmp_path)
    specs = list(mooncake(path, block_tokens=16, limit=10, repeat=0))
    assert [s.epoch for s in specs] == [0] * 5 + [1] * 5
    h, keep = BlockHasher(16), BlockHasher(16)
    seen: set[int] = set()
    for s in specs:
        got = h.hashes(s, s.prompt_len)
        # what a hasher that forgets nothing gives (every spec in epoch 0)
        assert got == keep.hashes(replace(s, epoch=0), s.prompt_len)
        if s.epoch == 0:
            seen |= set(got)
        else:
            assert not seen & set(got)
    assert 0 < len(h._chains) < len(keep._chains)
    with pytest.raises(ValueError, match="epoch 0 after epoch 1"):
        h.hashes(specs[0], 32)


def test_index_lookup_runs_and_tiers() -> None:
    """Leading runs per node with the best tier per block, stopping where nobody holds
    the next block (RedisBlockIndex.lookup's answer)."""
    idx = InProcessBlockIndex()
    idx.apply("a", stored=[(1, "device"), (2, "host"), (2, "device"), (3, "disk")])
    idx.apply("b", stored=[(1, "host"), (2, "host"), (4, "device")])
    got = idx.lookup_now([1, 2, 3, 4])
    assert got.num_blocks == 4
    assert got.nodes == {"a": ("device", "device", "disk"), "b": ("host", "host")}
    idx.apply("a", removed=[(2, "device")])
    assert idx.lookup_now([1, 2, 3]).nodes["a"] == ("device", "host", "disk")
    assert idx.lookup_now([1, 2], nodes={"b"}).nodes == {"b": ("host", "host")}
    assert idx.lookup_now([5, 1]).num_blocks == 0
