"""Async scheduling (engine/async_step.py): step n+1 is scheduled and launched before the
host has step n's tokens, and every output is the one synchronous scheduling gives
(and transformers' greedy), through chunked prefill, prefix hits, preemption, stops
found one step late, aborts while a step is in flight, sampling, penalties, structured
outputs, parallel samples and disaggregation."""

import argparse
import asyncio
import json
import random
import re
from dataclasses import replace

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
    # EOS: the id set above is not the tokenizer's, so (as vLLM) it is its stop reason
    assert any(s[2] == "stop" and s[3] == eos for s in got[True][0::4])
    assert ("stop", False, True) in reasons  # a stop string
    assert ("stop", False, False) in reasons  # a stop token id
    assert ("length", True, False) in reasons


def test_sampling_features_equal_sync():
    """Seeded sampling, min_tokens, logit_bias, logprobs, penalties, structured outputs
    and parallel samples, all in one batch."""
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


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"], "additionalProperties": False,
}


def mixed_params() -> list[SamplingParams]:
    """Plain, penalised, structured and parallel requests, greedy and seeded."""
    json_spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    compact = StructuredOutput("json_schema", json.dumps(SCHEMA), any_whitespace=False)
    regex = StructuredOutput("regex", "[0-9]{2}-[a-z]{2,5}")
    choice = StructuredOutput("choice", choices=("alpha", "beta gamma", "delta"))
    greedy = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=14, temperature=1.0, ignore_eos=True)
    return [
        greedy,
        replace(greedy, repetition_penalty=1.4),
        replace(greedy, presence_penalty=0.7, frequency_penalty=0.4, max_tokens=17),
        replace(seeded, seed=7, repetition_penalty=0.8, frequency_penalty=0.6),
        replace(greedy, ignore_eos=False, max_tokens=40, structured=compact),
        replace(seeded, ignore_eos=False, max_tokens=40, seed=3, structured=json_spec,
                presence_penalty=0.5),
        replace(seeded, ignore_eos=False, max_tokens=20, seed=5, structured=regex),
        replace(greedy, ignore_eos=False, max_tokens=20, structured=choice,
                repetition_penalty=1.2),
        replace(seeded, seed=11, n=2, frequency_penalty=0.3),
        replace(seeded, ignore_eos=False, max_tokens=20, seed=13, n=2, structured=regex),
        replace(greedy, max_tokens=9),
        replace(seeded, seed=17),
    ]


def test_penalties_grammars_and_forks_equal_sync_through_preemption(monkeypatch):
    """Penalised, structured, parallel and plain requests in one batch with too few
    blocks (preemption, of requests whose token is in flight too) and chunked prefill:
    token-identical to synchronous scheduling; greedy rows (with a repetition penalty
    too) equal transformers'."""
    import torch

    from engine.sampler import has_penalty
    from engine.scheduler import Scheduler

    prompts = make_prompts(12)
    params = mixed_params()
    kw = dict(num_blocks=44, max_num_batched_tokens=32, seed=1)
    sync, _ = generate(prompts, params, False, **kw)
    preempted = []  # (penalised, structured, forks to start, token in flight)
    preempt = Scheduler._preempt

    def recording(self, req, yielded=False):
        preempted.append((has_penalty(req.sampling_params), req.grammar is not None,
                          bool(req.forks), req.num_output_placeholders > 0))
        preempt(self, req, yielded)
    monkeypatch.setattr(Scheduler, "_preempt", recording)
    outs, llm = generate(prompts, params, True, **kw)
    assert (True, False, False, True) in preempted  # its newest token on the device
    assert (True, False, True, True) in preempted  # forks start on a recomputed prompt
    assert any(g for _, g, _, _ in preempted)
    # (not num_cached_tokens: prefix hits at admission depend on when blocks were freed)
    assert [summary(o)[:-1] for o in outs] == [summary(o)[:-1] for o in sync]
    assert len(outs) == 14  # two n=2 requests
    first = {}  # the first sample of each request, by its position in `params`
    for o in outs:
        first.setdefault(int(o.request_id.rsplit("-", 1)[1]), o)
    assert {o.request_id for o in outs} == {o.request_id for o in first.values()}
    structured = [first[i] for i in (4, 5, 6, 7)]
    assert all(o.finish_reason == "stop" for o in structured)
    # the grammar binds the sampled tokens (a random prompt may end inside a character,
    # whose replacement character then begins the text, as in vLLM's detokenizer)
    text = [llm.tokenizer.decode(o.token_ids) for o in structured]
    assert set(json.loads(text[0])) == {"name", "n"}
    assert re.fullmatch("[0-9]{2}-[a-z]{2,5}", text[2])
    assert text[3] in ("alpha", "beta gamma", "delta")
    hf = hf_model(model())
    for i in (0, 1, 10):
        p = params[i]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompts[i]]), max_new_tokens=p.max_tokens,
                              do_sample=False, repetition_penalty=p.repetition_penalty,
                              eos_token_id=None, pad_token_id=0)
        assert first[i].token_ids == ref[0, len(prompts[i]):].tolist()


def trace_launches(engine: LLMEngine) -> list[tuple[str, int]]:
    """Records ("launch", k) when step k's forward pass is queued, ("sample", k) when its
    sampling is, and ("result", k) when the host reads its tokens."""
    log: list[tuple[str, int]] = []
    forward, sample = engine.runner.forward, engine.runner.sample

    def traced_forward(*args, **kw):
        log.append(("launch", sum(1 for e in log if e[0] == "launch")))
        return forward(*args, **kw)

    def traced_sample(*args, **kw):
        k = sum(1 for e in log if e[0] == "sample")
        log.append(("sample", k))
        tokens = sample(*args, **kw)
        result = tokens.result

        def traced_result():
            log.append(("result", k))
            return result()
        tokens.result = traced_result
        return tokens
    engine.runner.forward, engine.runner.sample = traced_forward, traced_sample
    return log


def traced_run(prompts, params) -> tuple[list[tuple[str, int]], list[RequestOutput]]:
    llm = LLM(model(), dtype="float32", block_size=4, async_scheduling=True)
    log = trace_launches(llm.engine)
    return log, llm.generate(prompts, params)


def test_next_step_launches_before_the_host_sees_tokens():
    prompts = [list(range(10, 30)), list(range(40, 47))]
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for params in (plain, replace(plain, presence_penalty=0.5, repetition_penalty=1.2)):
        log, _ = traced_run(prompts, params)
        n = sum(1 for e in log if e[0] == "launch")
        assert n == 6  # prefill + 5 decodes: no step for a token past max_tokens
        for k in range(n - 1):  # penalties too: the history reads the ids on the device
            assert log.index(("sample", k + 1)) < log.index(("result", k))


def test_structured_steps_forward_before_and_sample_after_the_host_sees_tokens():
    """vLLM's deferred sampling: a grammar's mask needs the token in flight, so the step
    after it queues its forward pass, then reads that token, then samples."""
    prompts = [list(range(10, 30)), list(range(40, 47))]
    spec = StructuredOutput("regex", "[a-z]{8}")
    log, outs = traced_run(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                   structured=spec))
    assert all(len(o.token_ids) > 2 for o in outs)
    n = sum(1 for e in log if e[0] == "launch")
    assert n > 2
    for k in range(n - 1):
        assert log.index(("launch", k + 1)) < log.index(("result", k)) \
            < log.index(("sample", k + 1))


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
    """Plain, penalised and structured requests decoded side by side after a remote
    prefill: the tokens of the colocated synchronous engine."""
    from engine.async_llm import AsyncLLM
    from tests.unit.engine.test_disagg_hooks import BS, CallHandoff, remote_prefill

    prompts = [list(range(10, 27)), list(range(100, 130)), list(range(40, 61)),
               list(range(200, 211))]
    greedy = SamplingParams(max_tokens=10, temperature=0)
    params = [greedy, replace(greedy, presence_penalty=0.6, frequency_penalty=0.5),
              replace(greedy, max_tokens=16, repetition_penalty=1.3,
                      structured=StructuredOutput("regex", "[a-z]{3}-[0-9]{3}")),
              replace(greedy, temperature=1.0, seed=5, frequency_penalty=0.8)]
    ref = [o.token_ids for o in LLM(model(), dtype="float32", block_size=BS).generate(
        prompts, params)]

    def make(**kw) -> AsyncLLM:
        return AsyncLLM(make_engine_config(model(), dtype="float32", block_size=BS,
                                           num_blocks=96, async_scheduling=True, **kw),
                        handoff=CallHandoff())

    async def main():
        p, d = make(max_num_batched_tokens=8), make()
        try:
            async def one(i: int) -> list[int]:
                async def remote(alloc):
                    return await remote_prefill(p, d, alloc, prompts[i], [], params[i])
                got = [o async for o in d.generate(f"r{i}", prompts[i], params[i],
                                                   kv_params=remote)]
                return got[-1].token_ids
            outs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
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
    config = engine_config_from_args(p.parse_args(["--model", "/m", "--device", "cpu"]))
    assert config.async_scheduling is None and not config.schedules_async
    # vLLM's default: on for CUDA unless --no-async-scheduling
    assert engine_config_from_args(p.parse_args(["--model", "/m", "--device", "cuda"])
                                   ).schedules_async
    assert not engine_config_from_args(p.parse_args(["--model", "/m", "--device", "cuda",
                                                     "--no-async-scheduling"])).schedules_async


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


def test_fork_takes_the_prompt_kv_of_a_parent_that_moved_on():
    """A parallel sample forks when the host reads the first token: by then its parent
    may have computed that token (the child shares only the prompt's KV) or been
    preempted (the child recomputes)."""
    from engine.config import SchedulerConfig
    from engine.kv_cache_manager import KVCacheManager
    from engine.request import Request, RequestStatus
    from engine.scheduler import Scheduler

    s = Scheduler(SchedulerConfig(), KVCacheManager(64, 4))
    parents = [Request(f"p{i}", list(range(10, 20)), SamplingParams(max_tokens=5))
               for i in range(2)]
    for p in parents:
        s.add_request(p)
    for x in s.schedule().scheduled:  # the prompts; each samples its first token
        x.request.num_computed_tokens += x.num_new_tokens
        x.request.num_output_placeholders += 1
    moved, preempted = parents
    s._preempt(preempted)  # (the next schedule's victim)
    for x in s.schedule().scheduled:  # the next step computes the token in flight
        assert x.request is moved
        x.request.num_computed_tokens += x.num_new_tokens
        x.request.num_output_placeholders += 1
    kids = []
    for p in parents:
        p.num_output_placeholders -= 1
        p.append_token(42)  # the host reads the first token: the forks start
        kids.append(Request(p.request_id + "#1", list(p.prompt_token_ids), p.sampling_params))
        kids[-1].append_token(43)
    assert moved.num_computed_tokens == 11
    assert s.fork(moved, kids[0]) is not None  # the third block (prompt tokens 8, 9): copied
    assert kids[0].num_computed_tokens == 10 and s.kv.block_ids(kids[0].request_id)[:2] \
        == s.kv.block_ids(moved.request_id)[:2]
    assert s.fork(preempted, kids[1]) is None
    assert kids[1].status == RequestStatus.PREEMPTED and not s.kv.holds(kids[1].request_id)
    assert {x.request.request_id: x.num_new_tokens for x in s.schedule().scheduled} \
        == {"p0": 1, "p0#1": 1, "p1": 11, "p1#1": 11}
