"""The persistent batch (engine/input_batch.py): every step the engine lays out from it
equals the step laid out from the requests themselves (tests/unit/engine/step_reference.py), through slot reuse after finished,
aborted and preempted requests with a mix of sampling params, chunked prefill, prefix
hits, parallel samples and async scheduling; and each request samples with its own
params whichever slot it lands in."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from engine.input_batch import InputBatch
from engine.kv_cache_manager import KVCacheManager
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest
from engine.step_inputs import StepInputBuilder, StepInputs
from tests.factories import tiny_model_dir
from tests.unit.engine.step_reference import layout_of, reference_layout, sampled, step_on
from tests.unit.engine.test_correctness import make_prompts


def mixed_params(i: int) -> SamplingParams:
    """Greedy, seeded sampling, penalties, logprobs, min_tokens, parallel samples."""
    kinds: list[dict[str, Any]] = [
        dict(temperature=0),
        dict(temperature=0.8, top_k=20, top_p=0.9, seed=100 + i),
        dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5),
        dict(temperature=1.0, seed=7 + i, logprobs=3),
        dict(temperature=0, min_tokens=6, presence_penalty=0.7),
        dict(temperature=0.7, seed=3 + i, n=2),
    ]
    return SamplingParams(max_tokens=5 + (i * 3) % 11, ignore_eos=True, **kinds[i % len(kinds)])


def check_against_reference(engine: LLMEngine) -> list[int]:
    """Makes every step the runner builds from its batch also be laid out from the
    requests (`reference_layout`) and compared; returns the counts of steps checked
    (a list, so the caller sees it grow)."""
    runner = engine.runner
    planned = runner.inputs.build_planned
    checked = [0]

    def build_planned(plan: Any, batch: InputBatch, pad: Any = None, width: Any = None,
                      out: Any = None) -> StepInputs:
        want = reference_layout(plan.scheduled, engine.kv, runner.block_size, pad, width)
        got = planned(plan, batch, pad=pad, width=width, out=out)
        assert layout_of(got) == want
        checked[0] += 1
        return got

    runner.inputs.build_planned = build_planned  # type: ignore[method-assign]
    return checked


def run_mixed(async_scheduling: bool, seed: int, **kw: Any) -> tuple[dict[str, list], LLM]:
    """Requests of mixed params arriving over time, some aborted mid-way, on an engine
    with few seats and blocks (slots reused, preemption); every step checked against
    the reference layout and the batch's integrity. Returns each finished request's
    (sample index, tokens)."""
    llm = LLM(tiny_model_dir("llama"), dtype="float32", block_size=4, num_blocks=28,
              max_num_seqs=4, max_num_batched_tokens=24, async_scheduling=async_scheduling,
              **kw)
    e = llm.engine
    checked = check_against_reference(e)
    rng = random.Random(seed)
    prompts = make_prompts(14)
    pending = list(enumerate(prompts))
    aborted = {f"q{i}" for i in range(len(prompts)) if i % 5 == 2}
    tokens: dict[str, list] = {}
    steps = 0
    while pending or e.has_work():
        for _ in range(rng.randint(0, 2)):
            if pending:
                i, p = pending.pop(0)
                e.add_request(f"q{i}", p, mixed_params(i))
        for o in e.step():
            if o.finish_reason not in (None, "abort"):  # (each sample's last output)
                tokens.setdefault(o.request_id, []).append((o.index, o.token_ids))
        steps += 1
        if steps % 3 == 0:  # aborts land between steps, with a step maybe in flight
            for rid in sorted(aborted & set(e.scheduler.requests)):
                if e.scheduler.requests[rid].num_output_tokens >= 2:
                    e.abort(rid)
                    aborted.discard(rid)
        e.check_integrity()  # the batch mirrors its requests (InputBatch.check_integrity)
    assert checked[0] > 0
    return tokens, llm


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steps_equal_the_reference_through_reuse_preemption_and_aborts(
        async_scheduling: bool) -> None:
    tokens, llm = run_mixed(async_scheduling, seed=1)
    st = llm.engine.stats()
    assert st.num_preemptions > 0 and st.prefix_cache_hits > 0
    assert st.num_free_blocks == st.num_blocks
    # Every request that ran to the end has each of its samples' tokens.
    assert all(len(toks) == mixed_params(int(rid[1:])).n for rid, toks in tokens.items())
    assert len(llm.engine.runner.batch) == 0


def test_padded_graph_steps_equal_the_reference() -> None:
    """The fixed-address inputs of CUDA graphs (padded on CPU): decode and mixed steps
    built into the graphs' buffer from the batch equal the reference ones."""
    tokens, llm = run_mixed(True, seed=2, padded_decode=True, padded_mixed=True,
                            max_graph_tokens=32)
    assert tokens and llm.engine.stats().num_preemptions > 0


def test_each_request_samples_with_its_own_params_whatever_its_slot() -> None:
    """Run together on two seats (slots freed by finishes, aborts and preemptions and
    taken by requests of other params), each request's tokens are the ones it gets
    alone on a fresh engine (seeded and greedy sampling are batch-invariant), in sync
    and async scheduling alike; an id reused after an abort gets its own params."""
    d = tiny_model_dir("llama")
    prompts = make_prompts(8)
    params = [mixed_params(i) for i in range(5)] + [mixed_params(i) for i in range(6, 9)]

    def alone(prompt: list[int], p: SamplingParams) -> list[list[int]]:
        llm = LLM(d, dtype="float32", block_size=4, num_blocks=64)
        return [o.token_ids for o in llm.generate([prompt], p)]

    want = [alone(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    for async_scheduling in (False, True):
        llm = LLM(d, dtype="float32", block_size=4, num_blocks=24, max_num_seqs=2,
                  max_num_batched_tokens=16, async_scheduling=async_scheduling)
        e = llm.engine
        checked = check_against_reference(e)
        # "x" first runs greedy and is aborted; the id comes back with seeded sampling.
        e.add_request("x", prompts[0], SamplingParams(max_tokens=50, temperature=0,
                                                      repetition_penalty=1.5))
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            e.add_request(f"r{i}", prompt, p)
        got: dict[str, list[list[int]]] = {}
        readded = False
        while e.has_work():
            for o in e.step():
                if o.finish_reason not in (None, "abort"):
                    got.setdefault(o.request_id, []).append(o.token_ids)
            x = e.scheduler.requests.get("x")
            if not readded and x is not None and x.num_output_tokens >= 3:
                e.abort("x")
                e.add_request("x", prompts[1], params[1])
                readded = True
            e.check_integrity()
        assert readded and checked[0] > 0
        assert e.stats().num_preemptions > 0
        for i in range(len(prompts)):
            assert sorted(got[f"r{i}"]) == sorted(want[i]), (async_scheduling, i)
        assert got["x"] == want[1]


def test_a_reused_slot_keeps_no_blocks_of_its_former_request() -> None:
    """A slot a long request left, taken by a short one: its block-table row is the
    short request's alone (the reference's), and the batch grows past its capacity."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    batch = InputBatch(capacity=1, width=2)
    builder = StepInputBuilder(4, torch.device("cpu"), sliding_window=None)

    def step(sched: list[ScheduledRequest]) -> None:
        want = reference_layout(sched, kv, 4)
        assert layout_of(step_on(builder, batch, kv, sched)) == want
        for s in sched:  # the scheduler's side of the step
            s.request.num_computed_tokens += s.num_new_tokens

    long = Request("long", list(range(1, 30)), SamplingParams())  # 8 blocks
    assert kv.allocate_slots(long, long.num_tokens)
    step([ScheduledRequest(long, long.num_tokens)])
    kv.free(long)
    short = Request("short", [5, 6, 7], SamplingParams())
    other = Request("other", [9, 8, 7, 6, 5], SamplingParams())
    assert kv.allocate_slots(short, 3) and kv.allocate_slots(other, 5)
    step([ScheduledRequest(short, 3), ScheduledRequest(other, 5)])
    assert len(batch) == 2 and batch.capacity == 2
    assert batch.index["short"] == 0  # the long request's slot
    batch.check_integrity(kv)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_slots_are_freed_when_requests_leave_the_running_set(async_scheduling: bool) -> None:
    """Held prefill producers (finished, blocks kept until `release`) and finished
    requests give their slots back at once: six producers on two seats keep the batch
    at two slots, and the batch refers to no finished request after its last step."""
    llm = LLM(tiny_model_dir("llama"), dtype="float32", block_size=4, num_blocks=64,
              max_num_seqs=2, async_scheduling=async_scheduling)
    e = llm.engine
    batch = e.runner.batch
    prompts = make_prompts(8)
    for i, p in enumerate(prompts[:6]):
        e.add_request(f"p{i}", p, SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
    for i, p in enumerate(prompts[6:]):
        e.add_request(f"d{i}", p, SamplingParams(max_tokens=4, temperature=0))
    finished = 0
    while e.has_work():
        finished += sum(o.finished for o in e.step())
        # (the step that ends a request frees its slot: the batch keeps no finished one)
        assert all(r is None or not r.status.finished for r in batch.reqs)
        assert batch.capacity == 2
        e.check_integrity()
    assert finished == 8
    assert len(e.scheduler.held) == 6  # not released: their blocks are still held
    assert len(batch) == 0 and all(r is None for r in batch.reqs)
    for rid in list(e.scheduler.held):
        assert e.release(rid)
    e.check_integrity()


def test_a_growing_table_row_takes_its_new_blocks() -> None:
    """A request decoding past several blocks, its row widened on the way, and one
    taking a prefix hit next to it: each row equals its table (the reference's)."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    batch = InputBatch(capacity=2, width=2)
    builder = StepInputBuilder(4, torch.device("cpu"), sliding_window=None)
    a = Request("a", list(range(1, 8)), SamplingParams())  # 2 blocks
    assert kv.allocate_slots(a, a.num_tokens)
    sched = [ScheduledRequest(a, a.num_tokens)]
    for i in range(14):
        step = step_on(builder, batch, kv, sched)
        assert layout_of(step) == reference_layout(sched, kv, 4)
        sampled(step, sched, [100 + i] * len(sched))
        for s in sched:
            kv.cache_blocks(s.request, s.request.num_computed_tokens)
        batch.check_integrity(kv)
        sched = [ScheduledRequest(s.request, 1) for s in sched]
        if i == 5:  # "b" shares a's first full blocks (a prefix hit), then decodes
            b = Request("b", a.all_token_ids[:9], SamplingParams())
            hit, n = kv.get_computed_blocks(b)
            assert n == 8 and kv.allocate_slots(b, b.num_tokens - n, hit)
            b.num_computed_tokens = n
            sched.append(ScheduledRequest(b, b.num_tokens - n))
        for s in sched[:1] if i == 5 else sched:
            assert kv.allocate_slots(s.request, 1)
    assert batch.num_blocks[batch.index["a"]] == 5 and batch.tables.shape[1] > 2  # (widened)
