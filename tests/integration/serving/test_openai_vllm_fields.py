"""vLLM's sampling fields end to end on the shared cluster (conftest.py), against the
offline engine: allowed_token_ids, bad_words (n samples too), prompt_logprobs (vLLM's
shape, ranks included; chat `echo` asks for them) and min_tokens holding EOS back under
ignore_eos."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from tests.factories import one_token_word
from tests.integration.serving_util import call_http

PROMPT = "The quick brown fox jumps over"
MSGS = [{"role": "user", "content": "Tell me about foxes."}]


def _completion(port: int, body: dict) -> dict:
    status, r, _ = call_http(port, "POST", "/v1/completions", body)
    assert status == 200, r
    return r


def test_allowed_token_ids_and_bad_words(cluster, model, offline) -> None:
    base = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    plain = _completion(cluster.http_port, base)["choices"][0]["token_ids"]
    allowed = sorted(set(plain[1:4]))
    got = _completion(cluster.http_port, base | {"allowed_token_ids": allowed})
    ids = got["choices"][0]["token_ids"]
    assert set(ids) <= set(allowed)
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0,
                                                  ignore_eos=True, allowed_token_ids=allowed))
    assert ids == ref[0].token_ids
    word = offline.tokenizer.decode(plain[:2])
    got = _completion(cluster.http_port, base | {"bad_words": [word]})
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0,
                                                  ignore_eos=True, bad_words=[word]))
    assert got["choices"][0]["token_ids"] == ref[0].token_ids != plain
    status, r, _ = call_http(cluster.http_port, "POST", "/v1/chat/completions", {
        "model": model, "messages": MSGS, "max_tokens": 4, "allowed_token_ids": []})
    assert status == 400 and r["error"]["param"] is None and "empty" in r["error"]["message"]


def test_bad_words_hold_for_every_sample(cluster, model, offline) -> None:
    """n seeded samples with a bad word: no sample draws it, each is the offline
    engine's (the samples fork from one prefill, each masked on its own output)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0,
            "seed": 9, "n": 3, "ignore_eos": True, "return_token_ids": True}
    free = [c["token_ids"] for c in _completion(cluster.http_port, body)["choices"]]
    tok, vocab = offline.tokenizer, offline.engine.model_config.vocab_size
    # A one-token word that one of the samples drew.
    word, barred = one_token_word(tok, [t for s in free for t in s], vocab)
    got = [c["token_ids"] for c in _completion(cluster.http_port,
                                               body | {"bad_words": [word]})["choices"]]
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=9, n=3,
                                                  ignore_eos=True, bad_words=[word]))
    assert got == [o.token_ids for o in ref] != free
    assert not any(barred in ids for ids in got)


def test_prompt_logprobs(cluster, model, offline) -> None:
    r = _completion(cluster.http_port, {"model": model, "prompt": PROMPT, "max_tokens": 2,
                                        "temperature": 0, "prompt_logprobs": 2})
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0,
                                                  prompt_logprobs=2))[0]
    got = r["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ref.prompt_token_ids)
    assert ref.prompt_logprobs is not None
    for entry, lp, tok in zip(got[1:], ref.prompt_logprobs, ref.prompt_token_ids[1:],
                              strict=True):
        assert next(iter(entry)) == str(tok) and len(entry) in (2, 3)
        assert entry[str(tok)]["rank"] == getattr(lp, "rank", None)
        assert all(abs(entry[str(t)]["logprob"] - v) < 1e-4 for t, v in lp.items())
        assert entry[str(tok)]["decoded_token"] == offline.tokenizer.decode([tok], False)
    assert r["choices"][0]["logprobs"] is None
    status, r, _ = call_http(cluster.http_port, "POST", "/v1/chat/completions", {
        "model": model, "messages": MSGS, "max_tokens": 2, "prompt_logprobs": 0})
    assert status == 200 and r["prompt_logprobs"][0] is None
    assert all(len(e) == 1 and list(e.values())[0]["rank"] >= 1 for e in r["prompt_logprobs"][1:])
    chat = {"model": model, "messages": MSGS, "max_tokens": 2}
    status, echoed, _ = call_http(cluster.http_port, "POST", "/v1/chat/completions",
                                  chat | {"echo": True})
    assert status == 200 and echoed["prompt_logprobs"] == r["prompt_logprobs"]
    status, r, _ = call_http(cluster.http_port, "POST", "/v1/chat/completions", chat)
    assert status == 200 and r["prompt_logprobs"] is None


def test_min_tokens_holds_eos_back_under_ignore_eos(cluster, model, offline) -> None:
    eos = offline.tokenizer.eos_token_id
    r = _completion(cluster.http_port, {
        "model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "min_tokens": 3, "logit_bias": {str(eos): 100},
        "return_token_ids": True})
    ids = r["choices"][0]["token_ids"]
    assert eos not in ids[:3] and ids[3:] == [eos] * 3, ids
    assert r["choices"][0]["finish_reason"] == "length"
