"""The OpenAI surface without workers: every OpenAI / vLLM parameter we do not implement
is refused with a 400 naming it (through the HTTP front), defaults and unknown fields
pass; response objects (logprobs, echo, n, prompt lists) against vLLM-shaped golden
files; /tokenize and /detokenize."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.choices import Choices
from gateway.core import Gateway
from gateway.http_server import build_app
from gateway.openai_format import DONE, ResponseBuilder, sse
from gateway.params import IMPLEMENTED, REFUSED
from gateway.protocol import ModelContext, parse_chat, parse_completion
from protos import splitserve_pb2 as pb
from tests.factories import workerless_gateway

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")

# The parameters of the OpenAI API reference: each is implemented or refused.
OPENAI = {
    "completions": ["model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias",
                    "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop",
                    "stream", "stream_options", "suffix", "temperature", "top_p", "user"],
    "chat": ["messages", "model", "audio", "frequency_penalty", "function_call", "functions",
             "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata",
             "modalities", "n", "parallel_tool_calls", "prediction", "presence_penalty",
             "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier",
             "seed", "service_tier", "stop", "store", "stream", "stream_options",
             "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
             "verbosity", "web_search_options"],
}
# A value that asks for something, where `True` would not.
ASKING = {"min_p": 0.1,
          "modalities": ["text", "audio"], "service_tier": "flex"}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
BASE: dict[str, dict[str, Any]] = {
    "completions": {"prompt": "hi", "max_tokens": 2},
    "chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}


@pytest.fixture(scope="module")
def gw() -> Gateway:
    return workerless_gateway()


def _post(gw: Gateway, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        async with TestClient(TestServer(build_app(gw))) as client:
            resp = await client.post(path, json=body)
            return resp.status, await resp.json()
    return asyncio.run(go())


def test_every_openai_parameter_is_implemented_or_refused() -> None:
    for endpoint, names in OPENAI.items():
        missing = set(names) - IMPLEMENTED[endpoint] - set(REFUSED[endpoint])
        assert not missing, (endpoint, missing)


@pytest.mark.parametrize("endpoint,name", [(e, n) for e in REFUSED for n in sorted(REFUSED[e])])
def test_unsupported_parameter_is_400_naming_it(gw: Gateway, endpoint: str, name: str) -> None:
    status, body = _post(gw, PATHS[endpoint],
                         BASE[endpoint] | {name: ASKING.get(name, True)})
    assert status == 400, body
    assert body["error"]["param"] == name and name in body["error"]["message"]


def test_defaults_pass_and_unknown_fields_are_logged(gw: Gateway, caplog) -> None:
    harmless = {"completions": {"suffix": None, "use_beam_search": False, "min_p": 0.0,
                                "n": 1, "user": "u", "no_such_field": 1},
                "chat": {"store": False, "modalities": ["text"], "service_tier": "auto",
                         "echo": False, "no_such_field": 1}}
    with caplog.at_level(logging.WARNING, logger="gateway.params"):
        assert parse_completion(BASE["completions"] | harmless["completions"], gw.ctx)
        assert parse_chat(BASE["chat"] | harmless["chat"], gw.ctx)
    assert "no_such_field" in caplog.text and "ignored" in caplog.text


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "min_p": 1.5}, "min_p"),
    ({"prompt": "hi", "return_token_ids": "yes"}, "return_token_ids"),
    ({"prompt": "hi", "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]},
     "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}],
      "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
])
def test_bad_values_are_400(gw: Gateway, body: dict[str, Any], param: str) -> None:
    path = PATHS["chat" if "messages" in body else "completions"]
    status, out = _post(gw, path, body)
    assert status == 400 and out["error"]["param"] == param


def test_tokenize_and_detokenize(gw: Gateway) -> None:
    tok = gw.ctx.tokenizer
    status, out = _post(gw, "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    ids = tok.encode("hello world")
    assert status == 200 and out == {"count": len(ids), "max_model_len": gw.ctx.max_model_len,
                                     "tokens": ids, "token_strs": [tok.id_to_token(i)
                                                                   for i in ids]}
    msgs = [{"role": "user", "content": "hi"}]
    status, out = _post(gw, "/tokenize", {"messages": msgs})
    assert out["tokens"] == tok.encode_chat(msgs) and out["token_strs"] is None
    status, out = _post(gw, "/detokenize", {"tokens": ids})
    assert status == 200 and out == {"prompt": "<|begin_of_text|>hello world"}
    for bad in ([10**9], [-1], [True], [1.0], ["1"], [[1]]):
        assert _post(gw, "/detokenize", {"tokens": ids + bad})[0] == 400, bad
    long = ids * 2_000  # decoded with the GIL let go: the same text
    assert _post(gw, "/detokenize", {"tokens": long})[1]["prompt"] == \
        tok._tok.decode(long, skip_special_tokens=False)


# -- response objects against golden files ---------------------------------------------

def _lp(tok: int, value: float, top: list[tuple[int, float]]) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=tok, logprob=value, top=[
        pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def _deltas(ctx: ModelContext, prompt: list[int]) -> list[pb.WorkerGenerateResponse]:
    """Two samples of one prompt, interleaved as a worker streams them: sample 1 ends
    first; sample 0's first delta holds two tokens; logprobs with k = 2."""
    a, b, c = ctx.tokenizer.encode(" the quick fox", add_special_tokens=False)[:3]
    plp = [_lp(t, -1.5 - i, [(a, -1.0), (t, -1.5 - i)]) for i, t in enumerate(prompt[1:])]
    top = {a: -0.25, c: -3.0}  # the top 2 at every output position

    def r(i: int, toks: list[int], text: str, finish: str = "", **kw: Any
          ) -> pb.WorkerGenerateResponse:
        return pb.WorkerGenerateResponse(
            index=i, token_ids=toks, text=text, finish_reason=finish,
            num_prompt_tokens=len(prompt), num_output_tokens=kw.pop("n_out"),
            num_cached_tokens=0, logprobs=[_lp(t, top.get(t, -4.0), list(top.items()))
                                           for t in toks], **kw)
    return [r(0, [a, b], ctx.tokenizer.decode([a, b]), prompt_logprobs=plp, n_out=2),
            r(1, [c], ctx.tokenizer.decode([c]), prompt_logprobs=plp, n_out=1),
            r(1, [a], ctx.tokenizer.decode([a]), "length", n_out=2),
            r(0, [c], ctx.tokenizer.decode([c]), "stop", n_out=3)]


def _normalize(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: ("<id>" if k == "id" else 0 if k == "created" else _normalize(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_normalize(v) for v in obj]
    return obj


def _render(ctx: ModelContext, chat: bool, stream: bool) -> Any:
    body: dict[str, Any] = {"max_tokens": 3, "n": 2, "stream": stream}
    if chat:
        inps = [parse_chat(body | {"messages": [{"role": "user", "content": "Hi"}],
                                   "logprobs": True, "top_logprobs": 2}, ctx)]
    else:
        inps = parse_completion(body | {"prompt": "Hello", "echo": True, "logprobs": 2}, ctx)
    if stream:
        inps[0].include_usage = True
    b = ResponseBuilder("tiny", chat=chat)
    choices = Choices(inps, b, lambda ids: ctx.tokenizer.decode(ids, False))
    frames = [sse(b.chunk("", None, first=True, index=i)) for i in range(2)] if chat else []
    for r in _deltas(ctx, inps[0].prompt_token_ids):
        chunk = choices.chunk(choices.add(0, r))
        if chunk is not None:
            frames.append(sse(chunk))
    if not stream:
        return _normalize(choices.full())
    frames += [sse(b.usage_chunk(*choices.usage())), DONE]
    return [_normalize(json.loads(f[6:])) if f != DONE else "[DONE]" for f in frames]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_responses_match_vllm_golden_files(gw: Gateway, chat: bool, stream: bool) -> None:
    got = _render(gw.ctx, chat, stream)
    path = os.path.join(GOLDEN, f"{'chat' if chat else 'completions'}_"
                                f"{'stream' if stream else 'full'}.json")
    if os.environ.get("SPLITSERVE_WRITE_GOLDEN"):
        with open(path, "w") as f:
            json.dump(got, f, indent=1, ensure_ascii=False)
            f.write("\n")
    with open(path) as f:
        assert got == json.load(f)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stop_reason_names_the_stop_string_or_token(gw: Gateway, chat: bool) -> None:
    """vLLM's `stop_reason`: the matched stop string or stop token id, null for EOS and
    length; on the finishing chunk of a stream and in the whole response."""
    ctx = gw.ctx
    body: dict[str, Any] = {"max_tokens": 3, "n": 3, "stream": True}
    inps = [parse_chat(body | {"messages": [{"role": "user", "content": "Hi"}]}, ctx)] \
        if chat else parse_completion(body | {"prompt": "Hello"}, ctx)
    choices = Choices(inps, ResponseBuilder("tiny", chat=chat),
                      lambda ids: ctx.tokenizer.decode(ids, False))
    ends = [{"stop_str": "fox"}, {"stop_token_id": 7}, {}]
    chunks = []
    for i, end in enumerate(ends):
        for r in (pb.WorkerGenerateResponse(index=i, token_ids=[5], text="a",
                                            num_output_tokens=1),
                  pb.WorkerGenerateResponse(index=i, token_ids=[6], text="b",
                                            finish_reason="stop", num_output_tokens=2, **end)):
            chunks.append(choices.chunk(choices.add(0, r))["choices"][0])
    assert [c.get("stop_reason") for c in chunks] == [None, "fox", None, 7, None, None]
    assert [c["stop_reason"] for c in choices.full()["choices"]] == ["fox", 7, None]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(gw: Gateway) -> None:
    ctx = gw.ctx
    for chat in (False, True):
        body: dict[str, Any] = {"max_tokens": 3, "n": 2, "return_tokens_as_token_ids": True}
        inps = [parse_chat(body | {"messages": [{"role": "user", "content": "Hi"}],
                                   "logprobs": True, "top_logprobs": 2}, ctx)] if chat \
            else parse_completion(body | {"prompt": "Hello", "logprobs": 2}, ctx)
        choices = Choices(inps, ResponseBuilder("tiny", chat=chat),
                          lambda ids: ctx.tokenizer.decode(ids, False))
        for r in _deltas(ctx, inps[0].prompt_token_ids):
            choices.add(0, r)
        lps = choices.full()["choices"][0]["logprobs"]
        if chat:
            entry = lps["content"][0]
            first = _deltas(ctx, [1])[0].token_ids[0]
            assert entry["token"] == f"token_id:{first}"
            # vLLM: the chosen token's bytes are its text's; a top entry's, its name's
            assert entry["bytes"] == list(ctx.tokenizer.decode([first], False).encode())
            assert all(t["bytes"] == list(t["token"].encode()) for t in entry["top_logprobs"])
            assert all(t["token"].startswith("token_id:") for t in entry["top_logprobs"])
        else:
            assert all(t.startswith("token_id:") for t in lps["tokens"])
            assert all(k.startswith("token_id:") for top in lps["top_logprobs"] for k in top)
