"""Fail-over resume in the engine: a request given the tokens another worker already
streamed continues exactly where that stream stopped (tokens, text deltas, stop strings,
seeded sampling, max_tokens)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.llm import LLM
from engine.llm_engine import LLMEngine, RequestError
from engine.sampling_params import SamplingParams
from tests.factories import tiny_model_dir

PROMPT = [(11 * j) % 300 + 5 for j in range(21)]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLM(tiny_model_dir("llama"), num_blocks=64, block_size=16).engine


def stream(eng: LLMEngine, params: SamplingParams, resume: list[int] = (),  # type: ignore[assignment]
           stop_after: int | None = None) -> tuple[list[int], str, str | None]:
    """(new token ids, concatenated text deltas, finish reason) of one request; with
    `stop_after` the stream is cut (request aborted) once it holds that many tokens."""
    rid = f"r{id(params)}-{len(resume)}-{stop_after}"
    eng.add_request(rid, PROMPT, replace(params), resume_token_ids=resume)
    toks: list[int] = []
    text = ""
    while eng.has_work():
        for out in eng.step():
            toks += out.new_token_ids
            text += out.new_text
            if out.finished:
                return toks, text, out.finish_reason
            if stop_after is not None and len(out.token_ids) >= stop_after:
                eng.abort(rid)
                return toks, text, None
    raise AssertionError("the request never finished")


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True),
], ids=["greedy", "seeded"])
@pytest.mark.parametrize("cut", [1, 9, 23])
def test_resumed_stream_joins_the_cut_one(engine: LLMEngine, params: SamplingParams,
                                          cut: int) -> None:
    full, full_text, reason = stream(engine, params)
    assert len(full) == 24 and reason == "length"
    head, head_text, _ = stream(engine, params, stop_after=cut)
    assert head == full[:cut]
    tail, tail_text, reason = stream(engine, params, resume=head)
    assert head + tail == full and reason == "length"  # max_tokens counts the resumed
    assert head_text + tail_text == full_text
    engine.check_integrity()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks


def test_stop_string_across_the_cut(engine: LLMEngine) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full, full_text, _ = stream(engine, greedy)
    assert len(full_text) > 12
    stop = full_text[len(full_text) // 2 - 3:len(full_text) // 2 + 3]
    params = replace(greedy, stop=[stop])
    ref_toks, ref_text, ref_reason = stream(engine, params)
    assert ref_reason == "stop" and stop not in ref_text
    # Cut inside the stop string's span: the resumed detokenizer must see the head's
    # text to recognise it.
    for cut in range(1, len(ref_toks)):
        head, head_text, _ = stream(engine, params, stop_after=cut)
        tail, tail_text, reason = stream(engine, params, resume=head)
        assert (head + tail, head_text + tail_text, reason) == (ref_toks, ref_text, "stop")
    # Resumed tokens whose text holds the stop string already: the first new token
    # ends the request, and its stream shows no more text.
    tail, tail_text, reason = stream(engine, params, resume=ref_toks)
    assert (len(tail), tail_text, reason) == (1, "", "stop")


def test_resume_is_validated(engine: LLMEngine) -> None:
    p = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(RequestError, match="max_tokens"):
        engine.add_request("bad-1", PROMPT, p, resume_token_ids=[5, 6, 7, 8])
    with pytest.raises(RequestError, match="outside"):
        engine.add_request("bad-2", PROMPT, p, resume_token_ids=[10 ** 9])
    assert not engine.has_work()
