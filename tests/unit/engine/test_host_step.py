"""The per-step host work done for the whole batch at once gives what the per-request
path gives: block tables gathered from the persistent batch's rows (cut to the chunk,
following allocations and frees), and a step's newest tokens detokenized with their
joining context from memory."""

from __future__ import annotations

import random
import tempfile

import pytest
import torch

from engine.default_model import write_tokenizer
from engine.detokenizer import IncrementalDetokenizer
from engine.input_batch import InputBatch
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest
from engine.step_inputs import StepInputBuilder
from engine.tokenizer import Tokenizer
from tests.unit.engine.step_reference import layout_of, reference_layout, sampled, step_on


def test_block_tables_cut_to_the_chunk_and_follow_allocations() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    a = Request("a", list(range(10, 30)), SamplingParams())  # 20 tokens: 5 blocks held
    b = Request("b", list(range(40, 48)), SamplingParams())  # 8 tokens: 2 blocks
    assert kv.allocate_slots(a, a.num_tokens) and kv.allocate_slots(b, b.num_tokens)
    builder = StepInputBuilder(4, torch.device("cpu"), sliding_window=None)
    batch = InputBatch(capacity=2, width=2)
    # a's first chunk of 6 needs 2 of its 5 blocks; b's whole prompt its 2.
    sched = [ScheduledRequest(a, 6), ScheduledRequest(b, 8)]
    step = step_on(builder, batch, kv, sched)
    ta, tb = kv.block_ids("a"), kv.block_ids("b")
    assert len(ta) == 5
    assert step.meta.block_tables.tolist() == [ta[:2], tb]
    assert layout_of(step) == reference_layout(sched, kv, 4)
    # b samples and decodes into a third block: its row grows
    sampled(step, sched, [7])
    assert kv.allocate_slots(b, 1)
    assert len(kv.block_ids("b")) == 3
    sched = [ScheduledRequest(b, 1), ScheduledRequest(a, 1)]
    step = step_on(builder, batch, kv, sched)
    assert step.meta.block_tables.tolist() == [kv.block_ids("b"), ta[:2] + [0]]
    assert layout_of(step) == reference_layout(sched, kv, 4)
    sampled(step, sched, [8])
    batch.check_integrity(kv)
    kv.free(a)
    assert kv.block_ids("a") == [] and kv.table("a") is None
    batch.sync(kv)  # a's table freed: so is its slot
    assert "a" not in batch.index and "b" in batch.index
    kv.free(b)
    kv.check_integrity()


def test_detokenization_with_remembered_pieces_equals_decoding_afresh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with tempfile.TemporaryDirectory() as d:
        vocab = write_tokenizer(d)
        warm, cold = Tokenizer(d), Tokenizer(d)
    for tok in (warm, cold):  # the offsets path (where the tokenizer's stream cannot go)
        monkeypatch.setattr(tok, "decode_stream", lambda context, skip: None)
    rng = random.Random(0)
    # Multi-byte characters, special tokens (ids 0..), stop strings that match mid-way.
    stops = [(), ("e",), ("th", "xyz"), ()]
    outputs = [[rng.randrange(vocab) for _ in range(40)] for _ in range(8)]

    def make(tok: Tokenizer, i: int) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(tok, [20, 21, 22], stops[i % 4],
                                      skip_special_tokens=i % 3 != 0, include_stop=i % 2 == 1)
    fresh = [make(cold, i) for i in range(8)]
    remembered = [make(warm, i) for i in range(8)]
    for step in range(40):
        for a, b, out in zip(fresh, remembered, outputs, strict=True):
            cold._pieces = ({}, {})  # every joining context decoded afresh
            if not a.stopped:
                a.add_one(out[step])
            if not b.stopped:
                b.add_one(out[step])
        assert [d.take_delta() for d in remembered] == [d.take_delta() for d in fresh]
    assert [(d.text, d.stopped, d.stop_str) for d in remembered] == \
        [(d.text, d.stopped, d.stop_str) for d in fresh]
    assert any(d.stopped for d in fresh) and not all(d.stopped for d in fresh)
    assert any(any(warm.is_special(t) for t in out) for out in outputs)
    assert warm._pieces[True] and warm._pieces[False]


def test_piece_equals_decode_and_is_remembered_per_skip_value() -> None:
    with tempfile.TemporaryDirectory() as d:
        vocab = write_tokenizer(d)
        tok = Tokenizer(d)
    ids = [0, 1, *random.Random(1).sample(range(vocab), 200)]  # special tokens first
    for skip in (True, False):
        want = [tok.decode([t], skip) for t in ids]
        assert [tok.piece(t, skip) for t in ids] == want
        assert [tok.piece(t, skip) for t in ids] == want  # now from memory
        assert set(tok._pieces[skip]) == set(ids)
    assert tok.piece(0, True) != tok.piece(0, False)
