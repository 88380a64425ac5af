"""Stop semantics as vLLM v1's output path has them, on the tiny llama (greedy, its
output "ararK..." = [302, 302, 47, ...]): stop strings only after min_tokens, the
text of a stop token left out, running CUMULATIVE text without the held-back stop
buffer, the first listed stop string winning, and the finish / stop reasons of EOS
ids. Token ids are those of the plain run in every case (only text and reasons
differ)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from itertools import accumulate
from pathlib import Path

import pytest

from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
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


def test_stop_token_text_is_left_out(engine: LLMEngine, plain: RequestOutput) -> None:
    """vLLM v1 leaves the text of the token that stopped a request (a stop_token_ids
    hit or EOS) out of its text unless include_stop_str_in_output; its id stays in
    token_ids. EOS is drawn here by a logit bias (after min_tokens), its text shown
    (skip_special_tokens=False) unless it stopped the request."""
    out = run(engine, replace(BASE, stop_token_ids=[47]))[-1]
    assert out.token_ids == plain.token_ids[:3] and out.text == "arar"
    assert (out.finish_reason, out.stop_reason) == ("stop", 47)
    out = run(engine, replace(BASE, stop_token_ids=[47], include_stop_str_in_output=True))[-1]
    assert out.token_ids == plain.token_ids[:3] and out.text == "ararK"
    eos = engine.tokenizer.eos_token_id
    assert eos is not None
    forced = replace(BASE, ignore_eos=False, min_tokens=2, logit_bias={eos: 100.0},
                     skip_special_tokens=False)
    out = run(engine, forced)[-1]
    assert out.token_ids == [*plain.token_ids[:2], eos] and out.text == "arar"
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = run(engine, replace(forced, include_stop_str_in_output=True))[-1]
    assert out.text == "arar" + engine.tokenizer.decode([eos], False)
    out = run(engine, replace(forced, ignore_eos=True, min_tokens=0, max_tokens=2))[-1]
    assert out.token_ids == [eos, eos] and out.finish_reason == "length"  # not a stop
    assert out.text == engine.tokenizer.decode([eos, eos], False)


def test_running_cumulative_text_holds_back_like_delta(engine: LLMEngine) -> None:
    """vLLM v1 trims the held-back stop-string buffer from a running request's text,
    cumulative as delta (`output_text[:-stop_buffer_length]`): no output shows text
    a later one takes back (stop "rK": "a", "ara", "ara"; never "arar")."""
    outs = run(engine, replace(BASE, stop=["rK"], output_kind=RequestOutputKind.CUMULATIVE))
    texts = [o.text for o in outs]
    assert texts[-1] == "ara" and outs[-1].stop_reason == "rK"
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    deltas = run(engine, replace(BASE, stop=["rK"], output_kind=RequestOutputKind.DELTA))
    assert list(accumulate(o.new_text for o in deltas)) == texts


def test_eos_reasons(engine: LLMEngine, plain: RequestOutput, tmp_path: Path) -> None:
    """vLLM v1's check_stop tests EOS and stop_token_ids before the length: EOS as
    the max_tokens-th token ends the request "stop" (no stop reason). The model's EOS
    ids other than the tokenizer's (generation_config.json's list) are stop tokens to vLLM: the
    stop reason is the id, and their text is left out."""
    eos = engine.tokenizer.eos_token_id
    assert eos is not None
    forced = replace(BASE, ignore_eos=False, min_tokens=2, max_tokens=3,
                     logit_bias={eos: 100.0})
    out = run(engine, forced)[-1]
    assert out.token_ids == [*plain.token_ids[:2], eos]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    src = tiny_model_dir("llama")
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), tmp_path)
    for name in ("config.json", "generation_config.json"):  # vLLM reads the latter's
        cfg = json.loads((tmp_path / name).read_text())
        cfg["eos_token_id"] = [eos, 47]
        (tmp_path / name).write_text(json.dumps(cfg))
    two = LLM(str(tmp_path), block_size=4, num_blocks=64).engine
    out = run(two, replace(BASE, ignore_eos=False))[-1]
    assert out.token_ids == plain.token_ids[:3] and out.text == "arar"
    assert (out.finish_reason, out.stop_reason) == ("stop", 47)
    out = run(two, replace(forced, max_tokens=8))[-1]
    assert out.token_ids == [*plain.token_ids[:2], eos] and out.stop_reason is None
