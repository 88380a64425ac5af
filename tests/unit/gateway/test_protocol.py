"""Request validation at the gateway: every bad input is a 400 (404 for the model)
with vLLM's error shape, before any routing."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest, ModelNotFound
from gateway.protocol import ModelContext, parse_chat, parse_completion
from tests.factories import tiny_model_dir


@pytest.fixture(scope="module")
def ctx() -> ModelContext:
    return ModelContext(tiny_model_dir("llama"), "tiny", max_model_len=256)


def test_completion_defaults_and_fields(ctx: ModelContext) -> None:
    inp = parse_completion({"model": "tiny", "prompt": "hello world", "max_tokens": 5,
                            "temperature": 0, "stop": "x", "seed": 3, "top_k": -1,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}, ctx)[0]
    assert inp.prompt_token_ids == ctx.tokenizer.encode("hello world")
    p = inp.params
    assert (p.max_tokens, p.temperature, p.stop, p.seed, p.top_k, p.ignore_eos) == \
        (5, 0.0, ["x"], 3, None, True)
    assert inp.stream and inp.include_usage


def test_missing_max_tokens_is_vllms_default(ctx: ModelContext) -> None:
    # Completions: 16, which must fit as a given max_tokens must (vLLM's
    # build_tok_params: max_output_tokens=self.max_tokens); chat: the rest of it.
    assert parse_completion({"prompt": [1, 2, 3]}, ctx)[0].params.max_tokens == 16
    with pytest.raises(InvalidRequest, match="250 in the messages, 16 in the completion"):
        parse_completion({"prompt": [1] * 250}, ctx)
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, ctx)
    assert chat.params.max_tokens == 256 - len(chat.prompt_token_ids)


def test_chat_uses_template_and_max_completion_tokens(ctx: ModelContext) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    inp = parse_chat({"messages": msgs, "max_completion_tokens": 4}, ctx)
    assert inp.prompt_token_ids == ctx.tokenizer.encode_chat(msgs)
    assert inp.params.max_tokens == 4
    parts = parse_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], "max_tokens": 2}, ctx)
    assert parts.prompt_token_ids == inp.prompt_token_ids


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "temperature": 3.0}, "temperature"),
    ({"prompt": "x", "top_p": 0}, None),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"3": "high"}}, "logit_bias"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop": ["a", 1]}, "stop"),
    ({"prompt": "x", "seed": 2**63}, "seed"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", 5]}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
])
def test_bad_completion_is_400(ctx: ModelContext, body: dict, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as ei:
        parse_completion(body, ctx)
    err = ei.value.body()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("body", [
    [1, 2], "text", {"messages": []}, {"messages": "hi"}, {"messages": [{"content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
])
def test_bad_chat_is_400(ctx: ModelContext, body: object) -> None:
    with pytest.raises(InvalidRequest):
        parse_chat(body, ctx)


def test_unknown_model_is_404(ctx: ModelContext) -> None:
    with pytest.raises(ModelNotFound) as ei:
        parse_completion({"model": "other", "prompt": "x"}, ctx)
    assert ei.value.body() == {"error": {"message": "The model `other` does not exist.",
                                         "type": "NotFoundError", "param": "model",
                                         "code": 404}}


def test_worker_limit_lowers_the_context_limit() -> None:
    ctx = ModelContext(tiny_model_dir("llama"), "tiny")
    assert ctx.max_model_len == 1024
    ctx.observe_worker_limit(128)
    ctx.observe_worker_limit(512)  # never raised again
    assert ctx.max_model_len == 128
    assert parse_chat({"messages": [{"role": "user", "content": "hi"}]}, ctx) \
        .params.max_tokens == 128 - len(ctx.tokenizer.encode_chat(
            [{"role": "user", "content": "hi"}]))
    with pytest.raises(InvalidRequest):
        parse_completion({"prompt": [1, 2, 3], "max_tokens": 126}, ctx)


def test_truncate_prompt_tokens_keeps_the_last_k(ctx: ModelContext) -> None:
    inp = parse_completion({"prompt": list(range(1, 41)), "truncate_prompt_tokens": 8,
                            "max_tokens": 2}, ctx)[0]
    assert inp.prompt_token_ids == list(range(33, 41))
    msgs = [{"role": "user", "content": "a long question about foxes and dogs"}]
    full = parse_chat({"messages": msgs}, ctx).prompt_token_ids
    assert parse_chat({"messages": msgs, "truncate_prompt_tokens": 5},
                      ctx).prompt_token_ids == full[-5:]
    for bad in (0, -2, 257):
        with pytest.raises(InvalidRequest) as e:
            parse_completion({"prompt": [1, 2], "truncate_prompt_tokens": bad}, ctx)
        assert e.value.param == "truncate_prompt_tokens"


def test_continue_final_message_and_add_special_tokens(ctx: ModelContext) -> None:
    msgs = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "The colour is"}]
    inp = parse_chat({"messages": msgs, "continue_final_message": True,
                      "add_generation_prompt": False}, ctx)
    text = ctx.tokenizer.decode(inp.prompt_token_ids, False)
    assert text.endswith("The colour is")  # left open: no end-of-turn after it
    closed = ctx.tokenizer.apply_chat_template(msgs, False)
    assert closed.startswith(text) and len(closed) > len(text)
    with pytest.raises(InvalidRequest, match="add_generation_prompt"):
        parse_chat({"messages": msgs, "continue_final_message": True}, ctx)
    with pytest.raises(InvalidRequest, match="assistant"):
        parse_chat({"messages": msgs[:1], "continue_final_message": True,
                    "add_generation_prompt": False}, ctx)
    plain = parse_chat({"messages": msgs[:1]}, ctx).prompt_token_ids
    special = parse_chat({"messages": msgs[:1], "add_special_tokens": True},
                         ctx).prompt_token_ids
    assert special != plain and special[-len(plain):] == plain  # BOS added again


def test_disable_any_whitespace_reaches_the_worker_request() -> None:
    """vLLM's two spellings: structured_outputs.disable_any_whitespace and the backend
    option "xgrammar:disable-any-whitespace"; the flag survives the wire."""
    from engine.sampling_params import StructuredOutput
    from gateway.structured import structured_from_body
    from protos.convert import structured_from_proto, structured_to_proto

    schema = {"type": "object"}
    for body in ({"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
                 {"response_format": {"type": "json_object"},
                  "structured_outputs": {"disable_any_whitespace": True}},
                 {"guided_json": schema,
                  "guided_decoding_backend": "xgrammar:disable-any-whitespace"}):
        s = structured_from_body(body)
        assert s is not None and not s.any_whitespace, body
        assert structured_from_proto(structured_to_proto(s)) == s
    assert structured_from_body({"guided_json": schema}).any_whitespace
    choice = StructuredOutput("choice", choices=("a", "b"))
    assert structured_from_proto(structured_to_proto(choice)) == choice
