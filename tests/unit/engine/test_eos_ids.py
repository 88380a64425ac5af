"""The model's EOS ids as vLLM v1 uses them (vllm/sampling_params.py
update_from_generation_config, vllm/v1/core/sched/utils.py check_stop): the
tokenizer's EOS ends a request with no stop reason; the generation config's EOS ids
(generation_config.json's, config.json's when there is no such file) are stop tokens,
their id the stop reason; min_tokens holds back every one of them and the request's
stop_token_ids, ignore_eos or not (`_all_stop_token_ids`, MinTokensLogitsProcessor).

On the tiny llama (tokenizer EOS 4, greedy output [302, 302, 47, ...]); EOS is drawn
by a logit bias."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tests.factories import tiny_model_dir

PROMPT = [(7 * j) % 200 + 5 for j in range(13)]
BASE = SamplingParams(max_tokens=6, temperature=0)
EOS, THIRD = 4, 47  # the tokenizer's EOS; the plain run's third token


def engine(tmp_path: Path, config_eos: object, gen_eos: object | None) -> LLM:
    """The tiny llama with config.json's eos_token_id `config_eos` and a
    generation_config.json with `gen_eos` (None: no such file)."""
    out = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["eos_token_id"] = config_eos
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "generation_config.json").unlink()
    if gen_eos is not None:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    llm = LLM(str(out), block_size=4, num_blocks=64)
    assert llm.tokenizer.eos_token_id == EOS
    return llm


def run(llm: LLM, params: SamplingParams) -> RequestOutput:
    out = llm.generate(PROMPT, params)[0]
    llm.engine.check_integrity()
    return out


def test_the_tokenizers_eos_stops_outside_the_configs_list(tmp_path: Path) -> None:
    """A tokenizer EOS that neither config lists still ends the request (vLLM's
    `request.eos_token_id` is the tokenizer's), with no stop reason; the config's id
    ends it with its id."""
    eng = engine(tmp_path, THIRD, None)
    forced = run(eng, replace(BASE, min_tokens=2, logit_bias={EOS: 100.0}))
    assert forced.token_ids[2] == EOS and len(forced.token_ids) == 3
    assert (forced.finish_reason, forced.stop_reason) == ("stop", None)
    plain = run(eng, BASE)
    assert plain.token_ids == [302, 302, THIRD]
    assert (plain.finish_reason, plain.stop_reason) == ("stop", THIRD)


def test_generation_config_eos_ids_replace_config_json(tmp_path: Path) -> None:
    """Llama-3-Instruct's shape: config.json names one EOS (47 here),
    generation_config.json two, the tokenizer's (4) among them. vLLM reads the EOS
    list of generation_config.json: the tokenizer's EOS has no stop reason, the other
    its id; an id only config.json names is no stop token."""
    eng = engine(tmp_path, THIRD, [THIRD, EOS])
    forced = run(eng, replace(BASE, min_tokens=2, logit_bias={EOS: 100.0}))
    assert forced.token_ids[2] == EOS and forced.stop_reason is None
    assert run(eng, BASE).stop_reason == THIRD
    only_config = engine(tmp_path / "b", THIRD, [EOS])
    out = run(only_config, BASE)
    assert out.token_ids[:3] == [302, 302, THIRD] and out.finish_reason == "length"


def test_min_tokens_masks_every_eos_id_even_with_ignore_eos(tmp_path: Path) -> None:
    """vLLM masks all EOS ids and stop_token_ids until min_tokens, whether or not the
    request ignores EOS: a logit bias of +100 on EOS draws it only after min_tokens, and
    the generation config's other EOS id (47, the plain third token) is not drawn
    within them."""
    eng = engine(tmp_path, EOS, [EOS, THIRD])
    out = run(eng, replace(BASE, ignore_eos=True, min_tokens=2, logit_bias={EOS: 100.0}))
    assert out.token_ids == [302, 302, EOS, EOS, EOS, EOS] and out.finish_reason == "length"
    out = run(eng, replace(BASE, ignore_eos=True, min_tokens=3))
    assert out.token_ids[:2] == [302, 302] and THIRD not in out.token_ids[:3]
    out = run(eng, replace(BASE, min_tokens=3))
    assert THIRD not in out.token_ids[:3]
    ignoring = run(eng, replace(BASE, ignore_eos=True))
    assert ignoring.token_ids[:3] == [302, 302, THIRD] and ignoring.finish_reason == "length"


def test_a_grammar_ends_on_the_tokenizers_eos(tmp_path: Path) -> None:
    """vLLM's xgrammar backend (TokenizerInfo.from_huggingface) lets a completed grammar
    end only on the tokenizer's EOS, not on the generation config's other EOS ids: a
    choice of "ar" ends [302, EOS] even when the other id (47) is made likelier."""
    from engine.sampling_params import StructuredOutput

    eng = engine(tmp_path, [EOS, THIRD], [EOS, THIRD])
    choice = StructuredOutput("choice", choices=("ar",))
    out = run(eng, replace(BASE, structured=choice, logit_bias={THIRD: 50.0}))
    assert out.token_ids == [302, EOS] and (out.finish_reason, out.stop_reason) == ("stop", None)
