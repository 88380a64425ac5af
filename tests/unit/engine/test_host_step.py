"""The per-step host work done for the whole batch at once gives what the per-request
path gives: block tables gathered from the persistent batch's rows (cut to the chunk,
following allocations and frees), and a step's newest tokens detokenized in one
tokenizer call."""

from __future__ import annotations

import random
import tempfile

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


def test_batched_detokenization_equals_token_by_token() -> None:
    with tempfile.TemporaryDirectory() as d:
        vocab = write_tokenizer(d)
        tok = Tokenizer(d)
    rng = random.Random(0)
    # Multi-byte characters, special tokens (ids 0..), stop strings that match mid-way.
    stops = [(), ("e",), ("th", "xyz"), ()]
    outputs = [[rng.randrange(vocab) for _ in range(40)] for _ in range(8)]
    def make(i: int) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(tok, [20, 21, 22], stops[i % 4],
                                      skip_special_tokens=i % 3 != 0, include_stop=i % 2 == 1)
    one = [make(i) for i in range(8)]
    batched = [make(i) for i in range(8)]
    for step in range(40):
        for d, out in zip(one, outputs, strict=True):
            d.add([out[step]])
        IncrementalDetokenizer.add_newest(batched, [out[step] for out in outputs])
        assert [d.take_delta() for d in batched] == [d.take_delta() for d in one]
    assert [(d.text, d.stopped, d.stop_str) for d in batched] == \
        [(d.text, d.stopped, d.stop_str) for d in one]
    assert any(d.stopped for d in one) and not all(d.stopped for d in one)
    assert any(any(tok.is_special(t) for t in out) for out in outputs)


def test_decode_batch_equals_decode_and_remembers_single_ids() -> None:
    with tempfile.TemporaryDirectory() as d:
        vocab = write_tokenizer(d)
        tok = Tokenizer(d)
    rng = random.Random(1)
    seqs = [[rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 5]))]
            for _ in range(300)]
    seqs += [[0], [1], [0, 1]]  # special tokens
    for skip in (True, False):
        want = [tok.decode(s, skip) for s in seqs]
        assert tok.decode_batch(seqs, skip) == want
        assert tok.decode_batch(seqs, skip) == want  # single ids now remembered
    assert tok.decode_batch([[0]], True) != tok.decode_batch([[0]], False)
    assert tok.decode_batch([]) == []
