"""Seeded sampling, top-k/top-p, stop strings and stop tokens, as a user sees them."""

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.factories import tiny_model_dir


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_model_dir("llama"), dtype="float32", block_size=4, num_blocks=256)


PROMPTS = ["The quick brown fox", "Once upon a time", "def generate(", "Hello, how are"]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate(["The quick brown fox"], p)[0].token_ids
    batched = llm.generate(PROMPTS, [p] + [SamplingParams(max_tokens=12, temperature=1.0,
                                                          ignore_eos=True)] * 3)
    assert batched[0].token_ids == alone
    other_seed = llm.generate(["The quick brown fox"], SamplingParams(
        max_tokens=12, temperature=1.0, seed=43, ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))]
    top_k = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(
        max_tokens=8, temperature=1.5, top_k=1, ignore_eos=True))]
    top_p = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(
        max_tokens=8, temperature=1.5, top_p=1e-6, ignore_eos=True))]
    assert greedy == top_k == top_p


def test_stop_string_cuts_text_exactly(llm):
    full = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0,
                                                     ignore_eos=True))[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0,
                                                    ignore_eos=True, stop=[stop]))[0]
    assert cut.text == text[:text.find(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop  # vLLM's stop_reason
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]


def test_stop_token_ids_and_max_tokens(llm):
    full = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0,
                                                     ignore_eos=True))[0]
    assert len(full.token_ids) == 10 and full.finish_reason == "length"
    assert full.stop_reason is None
    stop_tok = full.token_ids[4]
    first = full.token_ids.index(stop_tok)
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0,
                                                    stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == full.token_ids[:first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_tok
    # The model's EOS ends with no stop_reason, as in vLLM, even when also listed.
    eos = llm.engine.eos_token_ids[0]
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=10, temperature=0,
                                                    logit_bias={eos: 100.0},
                                                    stop_token_ids=[eos]))[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None


def test_streamed_text_deltas_add_up_to_the_text(llm):
    eng = llm.engine
    eng.add_request("s", eng.tokenizer.encode(PROMPTS[2]),
                    SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    deltas, ids, last = [], [], None
    while eng.has_work():
        for o in eng.step():
            deltas.append(o.new_text)
            ids += o.new_token_ids
            last = o
    assert "".join(deltas) == last.text and ids == last.token_ids
    assert last.text == eng.tokenizer.decode(last.token_ids).rstrip("\ufffd")
