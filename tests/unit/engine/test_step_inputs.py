"""Step inputs built once per step, the padded fixed-address decode path that CUDA graphs
replay (run eagerly here: everything but the capture), and the Triton backend end to
end (under Triton's interpreter without a GPU): token-exact with transformers."""

from __future__ import annotations

import pytest
import torch

from engine.cuda_graphs import bucket_sizes
from engine.input_batch import InputBatch
from engine.kv_cache_manager import KVCacheManager
from engine.llm import LLM
from engine.request import Request
from engine.runner_graphs import make_decode_graphs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest
from engine.step_inputs import StepInputBuilder, layout_size, views
from tests.factories import hf_greedy, hf_model, tiny_model_dir
from tests.unit.engine.step_reference import layout_of, reference_layout, sampled, step_on


def _prompts(n: int, lengths: tuple[int, ...] = (5, 19, 33, 2, 47)) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 400 + 10 for j in range(lengths[i % len(lengths)])]
            for i in range(n)]


def test_layout_of_a_mixed_step_padding_and_sample_rows() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    a = Request("a", list(range(10, 20)), SamplingParams())  # 10 tokens, 6 cached
    b = Request("b", list(range(30, 33)), SamplingParams())  # 3 tokens, first chunk of 2
    for r in (a, b):
        assert kv.allocate_slots(r, r.num_tokens)
    a.num_computed_tokens = 6
    builder = StepInputBuilder(4, torch.device("cpu"), sliding_window=None)
    batch = InputBatch(capacity=2, width=2)
    sched = [ScheduledRequest(a, 4), ScheduledRequest(b, 2)]
    step = step_on(builder, batch, kv, sched)
    ta, tb = kv.block_ids("a"), kv.block_ids("b")
    assert step.input_ids.tolist() == [16, 17, 18, 19, 30, 31]
    assert step.positions.tolist() == [6, 7, 8, 9, 0, 1]
    assert step.meta.slot_mapping.tolist() == [ta[1] * 4 + 2, ta[1] * 4 + 3, ta[2] * 4,
                                               ta[2] * 4 + 1, tb[0] * 4, tb[0] * 4 + 1]
    assert step.meta.query_start_loc.tolist() == [0, 4, 6]
    assert step.meta.seq_lens.tolist() == [10, 2]
    assert step.meta.block_tables.tolist() == [ta[:3], [tb[0], 0, 0]]
    assert step.sample_rows.tolist() == [3]  # b's chunk ends before its prompt does
    assert [r.request_id for r in step.sample_reqs] == ["a"]
    assert step.in_flight is None
    assert layout_of(step) == reference_layout(sched, kv, 4)
    # a samples 77; both compute one token, padded to 4 one-token sequences (the decode
    # graphs' layout): padding is inert.
    sampled(step, sched, [77])
    assert kv.allocate_slots(a, 1) and kv.allocate_slots(b, 1)
    sched = [ScheduledRequest(a, 1), ScheduledRequest(b, 1)]
    padded = step_on(builder, batch, kv, sched, pad=(4, 4, 4), width=8)
    assert padded.input_ids.tolist() == [77, 32, 0, 0]
    assert padded.positions.tolist() == [10, 2, 0, 0]
    assert padded.meta.slot_mapping.tolist() == [ta[2] * 4 + 2, tb[0] * 4 + 2, -1, -1]
    assert padded.meta.seq_lens.tolist() == [11, 3, 0, 0]
    assert padded.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert padded.meta.block_tables.tolist() == [ta[:3] + [0] * 5, [tb[0]] + [0] * 7,
                                                 [0] * 8, [0] * 8]
    assert padded.sample_rows.tolist() == [0, 1, 0, 0]
    assert [r.request_id for r in padded.sample_reqs] == ["a", "b"]
    assert layout_of(padded) == reference_layout(sched, kv, 4, pad=(4, 4, 4), width=8)
    sampled(padded, sched, [5, 6])
    batch.check_integrity(kv)


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def _run(backend: str, arch: str, graphs: bool, n: int, max_tokens: int,
         **overrides: object) -> None:
    d = tiny_model_dir(arch, **overrides)
    llm = LLM(d, dtype="float32", num_blocks=96, block_size=16, max_num_seqs=8,
              max_num_batched_tokens=40, attention_backend=backend)
    runner = llm.engine.runner
    replays = []
    if graphs:
        runner.graphs = make_decode_graphs(runner, capture=False)
        run = runner.graphs.run
        runner.graphs.run = lambda b, step: replays.append(b) or run(b, step)  # type: ignore
    prompts = _prompts(n)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    hf = hf_model(d)
    eos = llm.engine.eos_token_ids[0] if llm.engine.eos_token_ids else None
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, max_tokens, eos), (backend, arch, p)
    if graphs:
        assert replays and set(replays) <= set(runner.graphs.buckets)
        assert any(b > 1 for b in replays)
    llm.engine.check_integrity()
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_padded_decode_path_equals_transformers() -> None:
    _run("torch", "llama", graphs=True, n=5, max_tokens=10)


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("qwen3", {}),
    ("mistral", {"sliding_window": 24}),
    ("qwen3_moe", {}),
    ("mixtral", {"sliding_window": 24}),
])
def test_triton_backend_equals_transformers(arch: str, overrides: dict) -> None:
    pytest.importorskip("triton")
    _run("triton", arch, graphs=arch == "llama", n=3, max_tokens=8, **overrides)


@pytest.mark.parametrize(("t", "b", "w", "s"), [(1, 1, 1, 1), (9099, 23, 65, 19),
                                                (16384, 30, 64, 30), (7, 3, 5, 2)])
def test_every_section_is_16_byte_aligned_whatever_the_counts(t, b, w, s):
    # Triton compiles a kernel variant per pattern of 16-byte-aligned pointer arguments:
    # sections at offsets that follow the counts would compile new variants mid-serving.
    buf = torch.zeros(layout_size(t, b, w, s), dtype=torch.int32)
    parts = views(buf, t, b, w, s)
    assert [p.numel() for p in parts] == [t, t, t, b + 1, b, b * w, s]
    assert all(p.data_ptr() % 16 == 0 for p in parts)  # (torch allocates 16-byte aligned)
    ends = [p.data_ptr() + 4 * p.numel() for p in parts]
    assert all(end <= nxt.data_ptr() for end, nxt in zip(ends, parts[1:]))  # no overlap
    assert ends[-1] <= buf.data_ptr() + 4 * buf.numel()
    with pytest.raises(ValueError, match="needs"):
        views(buf[:-1], t, b, w, s)
