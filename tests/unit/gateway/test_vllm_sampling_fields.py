"""vLLM's sampling extras the gateway takes as vLLM does: allowed_token_ids and
bad_words (vllm/entrypoints/openai/protocol.py) reach the workers' SamplingParams on
both endpoints and the gRPC wire; bad values get vLLM's 400s."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.protocol import ModelContext, parse_chat, parse_completion
from protos.convert import sampling_from_proto, sampling_to_proto
from tests.factories import tiny_model_dir

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def ctx() -> ModelContext:
    return ModelContext(tiny_model_dir("llama"), "tiny")


def _both(ctx: ModelContext, extra: dict[str, Any]) -> list[Any]:
    return [parse_completion({"prompt": "hi"} | extra, ctx)[0].params,
            parse_chat({"messages": MSGS} | extra, ctx).params]


def test_allowed_token_ids_and_bad_words_pass_through(ctx: ModelContext) -> None:
    for p in _both(ctx, {"allowed_token_ids": [47, 116], "bad_words": ["arar", "K"]}):
        assert p.allowed_token_ids == [47, 116] and p.bad_words == ["arar", "K"]
        assert sampling_from_proto(sampling_to_proto(p)) == p
    for p in _both(ctx, {"allowed_token_ids": None, "bad_words": []}):
        assert p.allowed_token_ids is None and p.bad_words == []
        assert sampling_from_proto(sampling_to_proto(p)) == p


@pytest.mark.parametrize("extra,words", [
    ({"allowed_token_ids": []}, "empty"),
    ({"allowed_token_ids": [10**6]}, "out-of-vocab"),
    ({"allowed_token_ids": ["a"]}, "integers"),
    ({"bad_words": [""]}, "empty string"),
    ({"bad_words": [" "]}, "at least one token"),
    ({"bad_words": "K"}, "array"),
])
def test_bad_values_are_400(ctx: ModelContext, extra: dict[str, Any], words: str) -> None:
    for parse in (lambda: parse_completion({"prompt": "hi"} | extra, ctx),
                  lambda: parse_chat({"messages": MSGS} | extra, ctx)):
        with pytest.raises(InvalidRequest, match=words):
            parse()


def test_logit_bias_is_clamped_to_100(ctx: ModelContext) -> None:
    """vLLM's SamplingParams.from_optional clamps each bias to [-100, 100] (the OpenAI
    range) rather than refusing it; a key that is no token id is still a 400."""
    for p in _both(ctx, {"logit_bias": {"47": 150, "5": -1e9, "6": 2.5}}):
        assert p.logit_bias == {47: 100.0, 5: -100.0, 6: 2.5}
    with pytest.raises(InvalidRequest, match="logit_bias"):
        parse_completion({"prompt": "hi", "logit_bias": {"x": 1}}, ctx)


def test_a_prompt_longer_than_the_context(ctx: ModelContext) -> None:
    """vLLM's 400s (serving_engine._validate_input): a chat prompt that leaves no room,
    without max_tokens, is named alone, never with a completion length the request did
    not ask for; /v1/completions' default max_tokens (16) must fit as a given one must."""
    limit = ctx.max_model_len
    with pytest.raises(InvalidRequest) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi " * limit}]}, ctx)
    msg = e.value.message
    assert msg.startswith(f"This model's maximum context length is {limit} tokens. "
                          "However, your request has ")
    assert msg.endswith(" input tokens. Please reduce the length of the input messages.")
    assert e.value.param == "prompt"
    ids = [5] * (limit - 5)
    with pytest.raises(InvalidRequest, match=rf"you requested {limit + 11} tokens "
                                             rf"\({limit - 5} in the messages, 16 in the "
                                             r"completion\)") as e:
        parse_completion({"prompt": ids}, ctx)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequest, match=r"\(1023 in the messages, 3 in the completion\)"):
        parse_completion({"prompt": [5] * 1023, "max_tokens": 3}, ctx)
    assert parse_completion({"prompt": [5] * (limit - 16)}, ctx)[0].params.max_tokens == 16
    assert parse_chat({"messages": MSGS}, ctx).params.max_tokens == \
        limit - len(parse_chat({"messages": MSGS}, ctx).prompt_token_ids)
