"""Async scheduling on CUDA (skipped without a GPU): the device runs step n while the
host builds step n+1, decode steps replay CUDA graphs whose input buffer receives the
placeholder ids on the device; outputs equal synchronous scheduling's and transformers'
greedy. Logprobs agree within float32 rounding, not bit for bit: a step's batch differs
between the two schedules (requests that finished at step n still ride step n+1 under
async scheduling) and a matmul's rounding depends on its row count."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.factories import hf_greedy, hf_model, tiny_model_dir
from tests.unit.engine.test_correctness import make_prompts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_async_scheduling_on_cuda_equals_sync_and_transformers(enforce_eager: bool) -> None:
    d = tiny_model_dir("llama")
    prompts = make_prompts(10)
    greedy = [SamplingParams(max_tokens=6 + i, temperature=0) for i in range(len(prompts))]
    mixed = [SamplingParams(max_tokens=10, temperature=0.9, seed=i, logprobs=2,
                            stop_token_ids=[7, 8, 9]) for i in range(len(prompts))]
    got, logprobs = {}, {}
    for on in (False, True):
        llm = LLM(d, dtype="float32", device="cuda", block_size=4, num_blocks=40,
                  max_num_batched_tokens=32, enforce_eager=enforce_eager,
                  async_scheduling=on)
        outs = llm.generate(prompts, greedy) + llm.generate(prompts, mixed)
        got[on] = [(o.token_ids, o.text, o.finish_reason) for o in outs]
        logprobs[on] = [o.logprobs for o in outs]
        llm.engine.check_integrity()
        st = llm.engine.stats()
        assert st.num_free_blocks == st.num_blocks and st.num_preemptions > 0
    assert got[True] == got[False]
    for sync_lps, async_lps in zip(logprobs[False], logprobs[True], strict=True):
        assert (sync_lps is None) == (async_lps is None)
        for a, b in zip(sync_lps or [], async_lps or [], strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) <= 1e-5 for t in a)
    hf = hf_model(d)
    eos = llm.engine.eos_token_ids[0]
    for p, params, g in zip(prompts, greedy, got[True], strict=False):
        assert g[0] == hf_greedy(hf, p, params.max_tokens, eos)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_penalties_grammars_and_forks_on_cuda_equal_sync(enforce_eager: bool) -> None:
    """Penalty histories filled from the device ids, deferred structured sampling and
    forks started a step later, through preemption, with graphs and eager."""
    from tests.unit.engine.test_async_scheduling import mixed_params

    prompts = make_prompts(12)
    got = {}
    for on in (False, True):
        llm = LLM(tiny_model_dir("llama"), dtype="float32", device="cuda", block_size=4,
                  num_blocks=44, max_num_batched_tokens=32, enforce_eager=enforce_eager,
                  seed=1, async_scheduling=on)
        got[on] = [(o.request_id, o.index, o.token_ids, o.text, o.finish_reason)
                   for o in llm.generate(prompts, mixed_params())]
        llm.engine.check_integrity()
        st = llm.engine.stats()
        assert st.num_free_blocks == st.num_blocks and st.num_preemptions > 0
    assert got[True] == got[False]


def test_token_masks_on_cuda_equal_sync() -> None:
    """allowed_token_ids and bad words (a prefix ending in the in-flight token compared
    on the device) under async scheduling on CUDA: the synchronous tokens."""
    prompts = make_prompts(8)
    params = [SamplingParams(max_tokens=10, temperature=0 if i % 2 else 0.8, seed=i,
                             ignore_eos=True, bad_words=["arar", "K"] if i % 3 else [],
                             allowed_token_ids=list(range(40, 400)) if i % 4 == 1 else None)
              for i in range(len(prompts))]
    got = {}
    for on in (False, True):
        llm = LLM(tiny_model_dir("llama"), dtype="float32", device="cuda", block_size=4,
                  num_blocks=40, max_num_batched_tokens=32, async_scheduling=on)
        got[on] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.engine.check_integrity()
    assert got[True] == got[False]
