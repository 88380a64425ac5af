"""Workloads and load shapes: lengths, shared prefixes, Mooncake hash-id blocks,
ShareGPT, multi-turn sessions, arrival offsets."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from bench import datasets as ds
from bench.base import BenchError
from bench.load import LoadSpec, start_offsets, units


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from engine.default_model import write_tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(str(d), vocab_size=512)
    return str(d)


@pytest.fixture(scope="module")
def pool(tok_dir: str) -> ds.TokenPool:
    return ds.TokenPool.from_tokenizer_dir(tok_dir)


def test_pool_ids_round_trip_through_the_tokenizer(tok_dir: str, pool: ds.TokenPool) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tok_dir}/tokenizer.json")
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    assert len(pool.ids) > 100
    for i in pool.ids:
        assert tok.id_to_token(i) not in special
        assert tok.encode(tok.decode([i]), add_special_tokens=False).ids == [i]


def test_length_distributions(pool: ds.TokenPool) -> None:
    const = ds.synthetic(pool, 20, ds.LengthDist(mean=33), ds.LengthDist(mean=7))
    assert {(r.prompt_len, r.output_len) for r in const} == {(33, 7)}
    assert all(len(r.prompt) == 33 for r in const)
    uni = ds.synthetic(pool, 300, ds.LengthDist("uniform", 100, 20), ds.LengthDist(mean=1))
    lens = [r.prompt_len for r in uni]
    assert min(lens) >= 80 and max(lens) <= 120 and len(set(lens)) > 20
    norm = ds.synthetic(pool, 400, ds.LengthDist("normal", 200, 10, hi=210),
                        ds.LengthDist(mean=1), seed=3)
    nl = [r.prompt_len for r in norm]
    assert max(nl) == 210 and 195 < statistics.mean(nl) < 205  # clipped at hi
    assert ds.synthetic(pool, 5, ds.LengthDist(mean=9), ds.LengthDist(mean=2), seed=1) == \
        ds.synthetic(pool, 5, ds.LengthDist(mean=9), ds.LengthDist(mean=2), seed=1)
    with pytest.raises(BenchError):
        ds.LengthDist("zipf")


def test_shared_prefix_groups(pool: ds.TokenPool) -> None:
    reqs = ds.shared_prefix(pool, num_groups=3, per_group=4, prefix_len=50, suffix_len=10,
                            output_len=5)
    assert len(reqs) == 12 and all(r.prompt_len == 60 for r in reqs)
    for g in range(3):
        group = [r for r in reqs if r.tag == f"group{g}"]
        assert len({r.prompt[:50] for r in group}) == 1
        assert len({r.prompt[50:] for r in group}) == 4
    assert len({r.prompt[:50] for r in reqs}) == 3


def write_trace(path: Path, records: list[dict]) -> str:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_mooncake_equal_hash_ids_give_equal_blocks(tmp_path: Path, pool: ds.TokenPool) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 1100, "output_length": 40, "hash_ids": [7, 8, 9]},
        {"timestamp": 3000, "input_length": 1024, "output_length": 3, "hash_ids": [7, 8]},
        {"timestamp": 4000, "input_length": 600, "output_length": 10, "hash_ids": [5, 9]},
    ])
    a, b, c = ds.mooncake(trace, pool, block_tokens=16, time_scale=0.5, output_scale=0.5)
    # 1100 = 512 + 512 + 76: the last block keeps ceil(76 * 16 / 512) = 3 tokens;
    # 600 = 512 + 88: ceil(88 * 16 / 512) = 3
    assert a.prompt_len == 16 + 16 + 3 and b.prompt_len == 32 and c.prompt_len == 16 + 3
    assert a.prompt[:32] == b.prompt  # ids 7, 8 shared
    assert c.prompt[:16] != a.prompt[:16]
    assert c.prompt[16:] == a.prompt[32:35]  # id 9: the same (partial) block
    assert [r.arrival_s for r in (a, b, c)] == [0.0, 1.0, 1.5]  # ms -> s, x0.5
    assert [r.output_len for r in (a, b, c)] == [20, 2, 5]
    assert len(ds.mooncake(trace, pool, limit=2)) == 2
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0}\n')
    with pytest.raises(BenchError, match="bad.jsonl:1"):
        ds.mooncake(str(tmp_path / "bad.jsonl"), pool)


def test_real_mooncake_trace_reuses_blocks(pool: ds.TokenPool) -> None:
    path = "/work/shared/data/mooncake/conversation_trace.jsonl"
    if not Path(path).is_file():
        pytest.skip("the shared Mooncake trace is not on this machine")
    reqs = ds.mooncake(path, pool, limit=50, block_tokens=8)
    assert len(reqs) == 50 and reqs[0].arrival_s == 0.0
    assert all(r.arrival_s is not None for r in reqs)
    assert len({r.prompt[:8] for r in reqs}) == 1  # every record starts with hash id 0


def test_sharegpt_single_and_multi_turn(tmp_path: Path, tok_dir: str) -> None:
    conv = [{"conversations": [{"from": "human", "value": "hello there"},
                               {"from": "gpt", "value": "general kenobi"},
                               {"from": "human", "value": "how are you"},
                               {"from": "gpt", "value": "fine"}]},
            {"conversations": [{"from": "gpt", "value": "starts wrong"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(conv))
    count = ds.TokenCounter(tok_dir)
    one = ds.sharegpt(str(path), count)
    assert len(one) == 1 and one[0].prompt == "hello there"
    assert one[0].output_len == count("general kenobi") and one[0].session is None
    multi = ds.sharegpt(str(path), count, multi_turn=True)
    assert [r.turn for r in multi] == [0, 1] and multi[1].session == multi[0].session
    assert multi[1].prompt.startswith("hello there\ngeneral kenobi\n")
    path.write_text("{}")
    with pytest.raises(BenchError):
        ds.sharegpt(str(path), count)


def test_multi_turn_sessions_grow_a_shared_history(pool: ds.TokenPool) -> None:
    reqs = ds.multi_turn(pool, num_sessions=2, turns=3, user_len=5, answer_len=4)
    s0 = [r for r in reqs if r.session == "s0"]
    assert [r.prompt_len for r in s0] == [5, 14, 23]
    assert s0[1].prompt[:5] == s0[0].prompt and s0[2].prompt[:14] == s0[1].prompt
    work = units(list(reversed(reqs)))
    assert len(work) == 2 and [r.turn for r in work[0]] == [0, 1, 2]


def test_load_offsets() -> None:
    work = [[object()] for _ in range(2000)]  # type: ignore[list-item]
    assert start_offsets(LoadSpec("constant", rate=4.0), work[:4]) == [0.0, 0.25, 0.5, 0.75]
    poisson = start_offsets(LoadSpec("poisson", rate=10.0, seed=1), work)  # type: ignore[arg-type]
    gaps = [b - a for a, b in zip(poisson, poisson[1:])]
    assert 0.09 < statistics.mean(gaps) < 0.11 and min(gaps) >= 0
    assert start_offsets(LoadSpec("concurrency", concurrency=3), work) is None  # type: ignore[arg-type]
    with pytest.raises(BenchError):
        LoadSpec("poisson")  # no rate
    with pytest.raises(BenchError):
        LoadSpec("burst", rate=1)
    random.seed(0)


def test_ideal_cached_ratio_of_shared_prefixes(pool: ds.TokenPool) -> None:
    from bench.experiments.routing import ideal_cached_ratio

    # g0a g1a g0b g1b, 48 tokens = 3 blocks each; the second of each group finds its
    # 32-token (2-block) prefix: 64 of 192 tokens.
    reqs = ds.shared_prefix(pool, num_groups=2, per_group=2, prefix_len=32, suffix_len=16,
                            output_len=1)
    assert ideal_cached_ratio(reqs) == pytest.approx(64 / 192)
    assert ideal_cached_ratio(reqs[:2]) == 0.0
