"""Stop semantics as vLLM v1's output path has them, on the tiny llama (greedy, its
output "ararK..." = [302, 302, 47, ...]): stop strings only after min_tokens, the
text of a stop token left out, running CUMULATIVE text without the held-back stop
buffer, the first listed stop string winning, and the finish / stop reasons of EOS
ids. Token ids are those of the plain run in every case (only text and reasons
differ)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tests.factories import tiny_model_dir

PROMPT = [(7 * j) % 200 + 5 for j in range(13)]
BASE = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request: pytest.FixtureRequest) -> LLMEngine:
    return LLM(tiny_model_dir("llama"), block_size=4, num_blocks=128,
               async_scheduling=request.param).engine


def run(eng: LLMEngine, params: SamplingParams) -> list[RequestOutput]:
    """Every output of one request."""
    rid = f"r{id(params)}-{len(eng.outputs._tracks)}"
    eng.add_request(rid, PROMPT, params)
    outs: list[RequestOutput] = []
    while eng.has_work():
        outs += [o for o in eng.step() if o.request_id == rid]
    eng.check_integrity()
    return outs


@pytest.fixture(scope="module")
def plain(engine: LLMEngine) -> RequestOutput:
    out = run(engine, BASE)[-1]
    assert out.token_ids[:3] == [302, 302, 47] and out.text.startswith("ararK")
    return out


def test_stop_strings_wait_for_min_tokens(engine: LLMEngine, plain: RequestOutput) -> None:
    """vLLM v1 searches stop strings only in the text of output tokens after the first
    min_tokens, a match reaching back into theirs: "ar" (tokens 1, 2) stops it at
    token 2 with min_tokens=1 and never with min_tokens=6; "rK" ends at token 3."""
    out = run(engine, replace(BASE, min_tokens=6, stop=["ar"]))[-1]
    assert out.token_ids == plain.token_ids and out.text == plain.text
    assert (out.finish_reason, out.stop_reason) == ("length", None)
    out = run(engine, replace(BASE, min_tokens=1, stop=["ar"]))[-1]
    assert out.token_ids == plain.token_ids[:2] and out.text == "ar"
    assert (out.finish_reason, out.stop_reason) == ("stop", "ar")
    out = run(engine, replace(BASE, min_tokens=2, stop=["rK"]))[-1]
    assert out.token_ids == plain.token_ids[:3] and out.text == "ara"
    assert out.stop_reason == "rK"


def test_first_listed_stop_string_wins(engine: LLMEngine, plain: RequestOutput) -> None:
    """vLLM v1 takes the first string in `stop` found in the new text, not the
    earliest match: stop=["r", "a"] on "ar" ends with "a" and stop "r"."""
    out = run(engine, replace(BASE, stop=["r", "a"]))[-1]
    assert (out.text, out.stop_reason) == ("a", "r")
    out = run(engine, replace(BASE, stop=["a", "r"]))[-1]
    assert (out.text, out.stop_reason) == ("", "a")
