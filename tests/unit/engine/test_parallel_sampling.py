"""Logprobs, prompt logprobs, n / best_of from one prefill, logit_bias and min_tokens in
the engine, against transformers (the reference) where numbers are involved."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.outputs import RankedLogprobs
from engine.sampling_params import SamplingParams
from tests.factories import hf_model, tiny_model_dir

PROMPT = [0] + [(7 * i) % 480 + 10 for i in range(21)]  # 22 tokens: 5 full 4-token blocks


@pytest.fixture(scope="module")
def llm() -> LLM:
    # A 8-token budget chunks the prompt: prompt logprobs cross chunk boundaries.
    return LLM(tiny_model_dir("llama"), dtype="float32", block_size=4, num_blocks=64,
               max_num_batched_tokens=8)


@pytest.fixture(scope="module")
def hf():
    return hf_model(tiny_model_dir("llama"))


def _ref_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_prompt_and_sampled_logprobs_equal_transformers(llm: LLM, hf) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.9, seed=11, logprobs=3,
                            prompt_logprobs=2)
    out = llm.generate([PROMPT], params)[0]
    ref = _ref_logprobs(hf, PROMPT + out.token_ids)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPT) - 1
    for pos, lp in enumerate(out.prompt_logprobs):  # entry pos scores prompt token pos+1
        row = ref[pos]
        tok = PROMPT[pos + 1]
        assert next(iter(lp)) == tok
        assert set(lp) - {tok} <= set(row.topk(2).indices.tolist())
        # vLLM's rank: the prompt token's place among all tokens (those at least as likely)
        assert isinstance(lp, RankedLogprobs) and lp.rank == int((row >= row[tok]).sum())
        for t, v in lp.items():
            assert abs(v - row[t].item()) < 1e-4
    assert out.logprobs is not None and len(out.logprobs) == 5
    for i, lp in enumerate(out.logprobs):
        row = ref[len(PROMPT) - 1 + i]
        tok = out.token_ids[i]
        assert next(iter(lp)) == tok and abs(lp[tok] - row[tok].item()) < 1e-4
        top = row.topk(3)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(lp[t] - v) < 1e-4  # the top 3, sampled token or not
    assert abs(out.cumulative_logprob - sum(lp[t] for lp, t in zip(out.logprobs,
                                                                    out.token_ids))) < 1e-6


def test_n_samples_share_one_prefill_and_its_blocks() -> None:
    eng = LLM(tiny_model_dir("llama"), dtype="float32", block_size=4, num_blocks=64).engine
    eng.add_request("r", PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=4))
    outs = eng.step()  # the prompt, once; four first tokens from its logits row
    assert sorted(o.index for o in outs) == [0, 1, 2, 3] and all(o.request_id == "r"
                                                                 for o in outs)
    assert eng.stats().prefix_cache_queries == len(PROMPT)  # one lookup, one prefill
    blocks = [eng.kv.req_blocks[rid] for rid in ("r", "r#1", "r#2", "r#3")]
    full = len(PROMPT) // 4
    for b in blocks[1:]:  # full prompt blocks shared, the partial one copied
        assert [x.block_id for x in b[:full]] == [x.block_id for x in blocks[0][:full]]
        assert b[full].block_id != blocks[0][full].block_id
    assert all(x.ref_cnt == 4 for x in blocks[0][:full])
    kv = eng.runner.kv_cache
    used = len(PROMPT) % 4
    for b in blocks[1:]:
        assert torch.equal(kv[b[full].block_id][:, :, :used],
                           kv[blocks[0][full].block_id][:, :, :used])
    while eng.has_work():
        outs += eng.step()
    finals = [o for o in outs if o.finish_reason]
    assert len(finals) == 4 and [o.finished for o in finals].count(True) == 1
    assert len({tuple(o.token_ids) for o in finals}) > 1  # four different samples
    eng.check_integrity()
    assert eng.stats().num_free_blocks == eng.stats().num_blocks


def test_seeded_samples_reproduce_and_best_of_keeps_the_likeliest(llm: LLM) -> None:
    four = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, seed=9, n=4,
                                                 logprobs=0))
    again = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, seed=9, n=4,
                                                  logprobs=0))
    assert [o.token_ids for o in four] == [o.token_ids for o in again]
    best = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=1.0, seed=9, n=2,
                                                 best_of=4))
    ranked = sorted(four, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked]
    assert [o.index for o in best] == [0, 1] and all(o.logprobs is None for o in best)


def test_logit_bias_and_min_tokens(llm: LLM) -> None:
    eos = llm.engine.eos_token_ids[0]
    forced = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0,
                                                   logit_bias={123: 100.0}))[0]
    assert forced.token_ids == [123] * 4
    to_eos = SamplingParams(max_tokens=6, temperature=0, logit_bias={eos: 100.0})
    assert llm.generate([PROMPT], to_eos)[0].token_ids == [eos]
    held = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, min_tokens=3,
                                                 logit_bias={eos: 100.0}))[0]
    assert len(held.token_ids) == 4 and eos not in held.token_ids[:3] \
        and held.token_ids[3] == eos and held.finish_reason == "stop"


def test_aborting_a_group_frees_every_sample() -> None:
    eng = LLM(tiny_model_dir("llama"), dtype="float32", block_size=4, num_blocks=64).engine
    eng.add_request("g", PROMPT, SamplingParams(max_tokens=50, temperature=1.0, n=3,
                                                ignore_eos=True))
    eng.step()
    eng.step()
    out = eng.abort("g")
    assert out is not None and out.finished and out.request_id == "g"
    assert not eng.has_work()
    eng.check_integrity()
    assert eng.stats().num_free_blocks == eng.stats().num_blocks
