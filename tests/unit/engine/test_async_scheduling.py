"""Async scheduling (engine/async_step.py): step n+1 is scheduled and launched before the
host has step n's tokens, and every output is the one synchronous scheduling gives
(and transformers' greedy), through chunked prefill, prefix hits, preemption, stops
found one step late, aborts while a step is in flight, sampling and disaggregation."""

import argparse
import asyncio
import random

from engine.cli import add_engine_arguments, engine_config_from_args
from engine.llm import LLM, make_engine_config
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutput
from tests.factories import hf_greedy, hf_model, tiny_model_dir
from tests.unit.engine.test_correctness import make_prompts


def model() -> str:
    return tiny_model_dir("llama")


def generate(prompts, params, async_scheduling: bool, **kw) -> tuple[list[RequestOutput], LLM]:
    """Runs to completion; checks that nothing leaked."""
    llm = LLM(model(), dtype="float32", block_size=4, async_scheduling=async_scheduling, **kw)
    outs = llm.generate(prompts, params)
    assert not llm.engine.has_work()
    llm.engine.check_integrity()
    st = llm.engine.stats()
    assert st.num_free_blocks == st.num_blocks
    return outs, llm


def summary(o: RequestOutput) -> tuple:
    return (o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs,
            o.cumulative_logprob, o.num_cached_tokens)


def test_greedy_equals_sync_and_transformers_through_chunks_hits_and_preemption():
    prompts = make_prompts(10)
    # max_tokens 4..13: requests end at different steps
    params = [SamplingParams(max_tokens=4 + i, temperature=0) for i in range(len(prompts))]
    kw = dict(num_blocks=40, max_num_batched_tokens=32)  # chunks, and too few blocks
    sync, _ = generate(prompts, params, False, **kw)
    outs, llm = generate(prompts, params, True, **kw)
    st = llm.engine.stats()
    assert st.num_preemptions > 0 and st.prefix_cache_hits > 0
    assert max(len(p) for p in prompts) > 32
    assert [summary(o) for o in outs] == [summary(o) for o in sync]
    hf = hf_model(model())
    eos = llm.engine.eos_token_ids[0]
    for prompt, p, out in zip(prompts, params, outs, strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, p.max_tokens, eos)


def test_stops_found_a_step_late_change_nothing():
    """EOS, stop strings, stop ids and max_tokens end requests at different steps; the
    extra token async scheduling computed for each is dropped and its blocks freed."""
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(2, 20))] for _ in range(8)]
    free = SamplingParams(max_tokens=24, temperature=0)
    ref, _ = generate(prompts, free, False)
    eos = ref[0].token_ids[5]  # a token the model emits mid-output, made EOS below
    params = []
    for i, o in enumerate(ref):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(max_tokens=24, temperature=0))  # EOS (or length)
        elif kind == 1 and len(o.text.strip()) > 12:
            params.append(SamplingParams(max_tokens=24, temperature=0, stop=[o.text[6:9]]))
        elif kind in (1, 2):
            params.append(SamplingParams(max_tokens=24, temperature=0,
                                         stop_token_ids=[o.token_ids[3 + i]]))
        else:
            params.append(SamplingParams(max_tokens=3 + i, temperature=0, ignore_eos=True))
    got = {}
    for on in (False, True):
        llm = LLM(model(), dtype="float32", block_size=4, async_scheduling=on)
        llm.engine.eos_token_ids = (eos,)
        got[on] = [summary(o) for o in llm.generate(prompts, params)]
        llm.engine.check_integrity()
        st = llm.engine.stats()
        assert st.num_free_blocks == st.num_blocks
    assert got[True] == got[False]
    reasons = {(s[2], s[3] is None, isinstance(s[3], str)) for s in got[True]}
    assert ("stop", True, False) in reasons  # EOS
    assert ("stop", False, True) in reasons  # a stop string
    assert ("stop", False, False) in reasons  # a stop token id
    assert ("length", True, False) in reasons


def test_sampling_features_equal_sync():
    """Seeded sampling, min_tokens, logit_bias and logprobs run async; penalties,
    structured outputs and parallel samples fall back to synchronous steps."""
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(3, 30))] for _ in range(7)]
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, seed=11, logprobs=2),
        SamplingParams(max_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=5,
                       min_tokens=6, stop_token_ids=[7, 8, 9, 10, 11]),
        SamplingParams(max_tokens=9, temperature=0, logit_bias={42: 3.0}, logprobs=1),
        SamplingParams(max_tokens=11, temperature=0.8, seed=3, repetition_penalty=1.3,
                       frequency_penalty=0.5),
        SamplingParams(max_tokens=12, temperature=1.0, seed=9,
                       structured=StructuredOutput("regex", "[a-z]{2,9}")),
        SamplingParams(max_tokens=8, temperature=1.0, seed=4, n=2),
        SamplingParams(max_tokens=10, temperature=1.0),  # unseeded: the engine's seed
    ]
    kw = dict(max_num_batched_tokens=16, seed=123)
    sync, _ = generate(prompts, params, False, **kw)
    outs, _ = generate(prompts, params, True, **kw)
    assert [summary(o) for o in outs] == [summary(o) for o in sync]
    assert len(outs) == 8  # n=2 gave two


def trace_launches(engine: LLMEngine) -> list[tuple[str, int]]:
    """Records ("launch", k) when step k is queued and ("result", k) when the host
    reads its tokens."""
    log: list[tuple[str, int]] = []
    launch = engine.runner.launch

    def traced(*args, **kw):
        k = sum(1 for e in log if e[0] == "launch")
        log.append(("launch", k))
        tokens = launch(*args, **kw)
        result = tokens.result

        def traced_result():
            log.append(("result", k))
            return result()
        tokens.result = traced_result
        return tokens
    engine.runner.launch = traced
    return log


def test_next_step_launches_before_the_host_sees_tokens():
    prompts = [list(range(10, 30)), list(range(40, 47))]
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(model(), dtype="float32", block_size=4, async_scheduling=True)
    log = trace_launches(llm.engine)
    llm.generate(prompts, plain)
    n = sum(1 for e in log if e[0] == "launch")
    assert n == 6  # prefill + 5 decodes: no step for a token past max_tokens
    for k in range(n - 1):
        assert log.index(("launch", k + 1)) < log.index(("result", k))
    # a penalty needs the host to have the token: each step is read before the next
    llm2 = LLM(model(), dtype="float32", block_size=4, async_scheduling=True)
    log2 = trace_launches(llm2.engine)
    llm2.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                          presence_penalty=0.5))
    for k in range(sum(1 for e in log2 if e[0] == "launch") - 1):
        assert log2.index(("result", k)) < log2.index(("launch", k + 1))


def test_abort_while_a_step_is_in_flight():
    prompts = [list(range(10, 40)), list(range(50, 60)), list(range(70, 95))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref, _ = generate(prompts, params, False, max_num_batched_tokens=16)
    engine = LLMEngine(make_engine_config(model(), dtype="float32", block_size=4,
                                          max_num_batched_tokens=16, async_scheduling=True))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outs: dict[str, RequestOutput] = {}
    aborted = None
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id] = o
        in_flight = engine.async_steps.in_flight
        if aborted is None and "r1" in outs and in_flight is not None \
                and any(s.request.request_id == "r1" for s in in_flight.out.scheduled):
            aborted = engine.abort("r1")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert 0 < len(aborted.token_ids) < 12
    assert outs["r1"].token_ids == ref[1].token_ids[:len(outs["r1"].token_ids)]
    assert [outs["r0"].token_ids, outs["r2"].token_ids] == [ref[0].token_ids, ref[2].token_ids]
    engine.check_integrity()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_remote_prefill_with_async_scheduling_on_both_engines():
    from engine.async_llm import AsyncLLM
    from tests.unit.engine.test_disagg_hooks import BS, CallHandoff, remote_prefill

    prompts = [list(range(10, 27)), list(range(100, 130))]
    params = SamplingParams(max_tokens=10, temperature=0)
    ref = [o.token_ids for o in LLM(model(), dtype="float32", block_size=BS).generate(
        prompts, params)]

    def make(**kw) -> AsyncLLM:
        return AsyncLLM(make_engine_config(model(), dtype="float32", block_size=BS,
                                           num_blocks=96, async_scheduling=True, **kw),
                        handoff=CallHandoff())

    async def main():
        p, d = make(max_num_batched_tokens=8), make()
        try:
            outs = []
            for i, prompt in enumerate(prompts):
                async def remote(alloc, prompt=prompt):
                    return await remote_prefill(p, d, alloc, prompt, [])
                got = [o async for o in d.generate(f"r{i}", prompt, params, kv_params=remote)]
                outs.append(got[-1].token_ids)
            assert outs == ref
            for eng in (p, d):
                await eng.call(lambda e: e.check_integrity())
                st = eng.stats()
                assert st.num_free_blocks == st.num_blocks
        finally:
            p.shutdown()
            d.shutdown()

    asyncio.run(main())


def test_cli_flag():
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_config_from_args(p.parse_args(["--model", "/m", "--device", "cpu",
                                                 "--async-scheduling"])).async_scheduling
    assert not engine_config_from_args(p.parse_args(["--model", "/m", "--device", "cpu"])
                                       ).async_scheduling


def test_tensor_parallel_ranks_get_the_placeholder_ids():
    """Rank 0 writes the placeholder ids into the step's buffer before it broadcasts it."""
    prompts = make_prompts(4)
    params = SamplingParams(max_tokens=8, temperature=0)
    ref, _ = generate(prompts, params, False, max_num_batched_tokens=32)
    llm = LLM(model(), dtype="float32", block_size=4, max_num_batched_tokens=32,
              tensor_parallel_size=2, async_scheduling=True)
    try:
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        llm.engine.check_integrity()
    finally:
        llm.engine.close()


def test_offload_tier_loads_and_saves_with_async_scheduling():
    """Blocks evicted to a host tier come back for the reruns (loads land while a step
    may be in flight); outputs stay transformers' greedy and nothing leaks."""
    from kvtransfer.tiers import TierConfig
    from kvtransfer.tiers.manager import TieredCache
    from tests.unit.engine.test_offload import BS, MAX_TOKENS, layout_of, run_twice

    d = model()
    hf = hf_model(d)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(26)] for _ in range(4)]
    eos = hf.generation_config.eos_token_id
    ref = [hf_greedy(hf, p, MAX_TOKENS, eos) for p in prompts]
    with TieredCache(TierConfig(host_blocks=64), layout_of(d)) as tiers:
        llm = LLM(d, offload=tiers, dtype="float32", block_size=BS, num_blocks=16,
                  async_scheduling=True)
        run_twice((d, prompts, ref), tiers, "host", llm)


def test_scheduler_counts_placeholders():
    """A token in flight is computed by the next step; a request whose token in flight
    is its last is not scheduled again; a preempted request waits for its token."""
    from engine.config import SchedulerConfig
    from engine.kv_cache_manager import KVCacheManager
    from engine.request import Request
    from engine.scheduler import Scheduler

    s = Scheduler(SchedulerConfig(), KVCacheManager(64, 4))
    a = Request("a", list(range(10, 20)), SamplingParams(max_tokens=3))
    b = Request("b", list(range(30, 36)), SamplingParams(max_tokens=8))
    for r in (a, b):
        s.add_request(r)
    out = s.schedule()
    for x in out.scheduled:  # what AsyncSteps does at launch: both sample
        x.request.num_computed_tokens += x.num_new_tokens
        x.request.num_output_placeholders += 1
    assert {x.request.request_id: x.num_new_tokens for x in s.schedule().scheduled} \
        == {"a": 1, "b": 1}
    a.append_token(5)
    a.append_token(6)  # a's token in flight would be its third and last
    a.num_computed_tokens += 2
    assert [x.request.request_id for x in s.schedule().scheduled] == ["b"]
    s._preempt(b)
    assert b.num_output_placeholders == 1
    assert [x.request.request_id for x in s.schedule().scheduled] == []  # b waits
    b.num_output_placeholders = 0  # its token arrived
    b.append_token(9)
    assert [x.request.request_id for x in s.schedule().scheduled] == ["b"]
