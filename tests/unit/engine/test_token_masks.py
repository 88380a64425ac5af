"""allowed_token_ids and bad_words as vLLM v1 applies them (vllm/v1/sample/sampler.py,
vllm/v1/sample/ops/bad_words.py, vllm/sampling_params.py update_from_tokenizer): every
token outside allowed_token_ids, and the last token of a bad word whose other tokens end
the output, get -inf before sampling; the logprobs stay those of the raw logits.

On the tiny llama, greedy: [302, 302, 47, 116, 338, ...] ("ar", "ar", "K", ...); "arar"
tokenizes to [302, 302], "K" to [47]. Sync and async scheduling (under async the
newest token a bad word's prefix needs may still be on the device)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.llm import LLM
from engine.llm_engine import RequestError
from engine.sampling_params import SamplingParams
from tests.factories import tiny_model_dir

PROMPT = [(7 * j) % 200 + 5 for j in range(13)]
BASE = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PLAIN = [302, 302, 47, 116, 338, 468, 36, 47]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request: pytest.FixtureRequest) -> LLM:
    out = LLM(tiny_model_dir("llama"), block_size=4, num_blocks=128,
              async_scheduling=request.param)
    assert out.generate(PROMPT, BASE)[0].token_ids == PLAIN
    return out


def test_allowed_token_ids(llm: LLM) -> None:
    """Only the allowed ids are drawn (greedy: the best of them, sampled: any of
    them); logprobs are of the raw logits (the top one is 302, not allowed)."""
    out = llm.generate(PROMPT, replace(BASE, allowed_token_ids=[47, 116], logprobs=1))[0]
    assert set(out.token_ids) <= {47, 116}
    assert out.logprobs is not None and list(out.logprobs[0]) == [out.token_ids[0], 302]
    sampled = llm.generate(PROMPT, replace(BASE, temperature=1.0, seed=3,
                                           allowed_token_ids=[5, 6, 7]))[0]
    assert set(sampled.token_ids) <= {5, 6, 7}
    for bad in ([], [llm.engine.model_config.vocab_size]):
        with pytest.raises(RequestError, match="allowed_token_ids"):
            llm.engine.validate(PROMPT, replace(BASE, allowed_token_ids=bad))


def test_bad_words(llm: LLM) -> None:
    """A one-token bad word is never drawn; a longer one's last token is barred only
    right after the rest of it (the output's own tokens, not the prompt's)."""
    out = llm.generate(PROMPT, replace(BASE, bad_words=["K"]))[0]
    assert out.token_ids[:2] == PLAIN[:2] and 47 not in out.token_ids
    out = llm.generate(PROMPT, replace(BASE, bad_words=["arar"]))[0]
    assert out.token_ids[:3] == [302, 215, 47]  # 215: the best after 302
    assert all(a != 302 or b != 302 for a, b in zip(out.token_ids, out.token_ids[1:]))
    # Only output tokens make a prefix: the prompt ends in 89, and "uar" is [89, 302].
    assert llm.generate(PROMPT, replace(BASE, bad_words=["uar"]))[0].token_ids == PLAIN
    with pytest.raises(RequestError, match="bad_words"):
        llm.engine.validate(PROMPT, replace(BASE, bad_words=[""]))


def test_ids_outside_the_models_vocabulary_are_refused() -> None:
    """A tokenizer may know tokens the model never draws (here 512 against a vocabulary of
    400): a bad word that tokenizes to one of them, an allowed id or a logit_bias key at
    or above the vocabulary size is a RequestError before the request runs (vLLM's
    SamplingParams.verify and update_from_tokenizer), never an index into the logits."""
    small = LLM(tiny_model_dir("llama", vocab_pad=-112), block_size=4, num_blocks=64)
    eng = small.engine
    assert eng.model_config.vocab_size == 400 < eng.tokenizer.vocab_size
    assert eng.tokenizer.encode("fox", add_special_tokens=False) == [74, 474]
    for params, words in ((replace(BASE, bad_words=["fox"]), "specified as bad: \\[474"),
                          (replace(BASE, allowed_token_ids=[5, 400]), "out-of-vocab"),
                          (replace(BASE, logit_bias={400: 1.0}), "Vocabulary size: 400")):
        with pytest.raises(RequestError, match=words):
            eng.add_request("x", PROMPT, params)
    out = small.generate(PROMPT, replace(BASE, bad_words=["the"], allowed_token_ids=[5, 399],
                                         logit_bias={399: 1.0}))[0]
    assert out.finish_reason == "length" and set(out.token_ids) <= {5, 399}
    eng.check_integrity()


def test_bad_words_are_tokenized_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validated when it arrives and again as it starts, a request's bad words become
    token ids once (vLLM's update_from_tokenizer, in process_inputs), offline and
    through AsyncLLM; a copy of the params (dataclasses.replace) is tokenized anew."""
    import asyncio

    import engine.llm_engine
    from engine.async_llm import AsyncLLM
    from engine.llm import make_engine_config
    from engine.tokenizer import bad_word_ids

    calls: list[list[str]] = []

    def counting(tok, words, vocab):  # type: ignore[no-untyped-def]
        calls.append(list(words))
        return bad_word_ids(tok, words, vocab)

    monkeypatch.setattr(engine.llm_engine, "bad_word_ids", counting)
    params = replace(BASE, bad_words=["arar"])
    llm = LLM(tiny_model_dir("llama"), block_size=4, num_blocks=64)
    out = llm.generate(PROMPT, params)[0]
    assert out.token_ids[:3] == [302, 215, 47] and calls == [["arar"]]
    llm.generate(PROMPT, replace(params, bad_words=["K"]))
    assert calls == [["arar"], ["K"]]
    # params whose words changed after validation are tokenized again, never barred
    # by the old words' ids
    params.bad_words = ["K"]
    llm.engine.validate(PROMPT, params)
    assert calls[-1] == ["K"] and params.bad_words_token_ids == [[47]]

    async def run() -> list[int]:
        alm = AsyncLLM(make_engine_config(tiny_model_dir("llama"), block_size=4,
                                          num_blocks=64))
        try:
            outs = [o async for o in alm.generate("a", PROMPT, replace(BASE, bad_words=["K"]))]
        finally:
            alm.shutdown()
        return outs[-1].token_ids

    calls.clear()
    ids = asyncio.run(run())
    assert 47 not in ids and ids[:2] == PLAIN[:2] and calls == [["K"]]
