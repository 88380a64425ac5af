"""vLLM's request fields as the gateway takes them (vllm/entrypoints/openai/protocol.py,
serving_engine.py, vllm/sampling_params.py): allowed_token_ids, bad_words and
prompt_logprobs reach the workers' SamplingParams on both endpoints and the gRPC wire,
prompt logprobs come back in vLLM's shape (chat `echo` asks for them), logit_bias is
clamped, token ids outside the model's vocabulary and the context length get vLLM's
400s, as do other bad values."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.choices import Choices
from gateway.errors import InvalidRequest
from gateway.openai_format import ResponseBuilder
from gateway.protocol import ModelContext, parse_chat, parse_completion
from protos import splitserve_pb2 as pb
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


def test_ids_outside_the_models_vocabulary_are_400() -> None:
    """vLLM's SamplingParams.verify and update_from_tokenizer: allowed_token_ids and
    logit_bias keys index the logits, so each must be below the model's vocabulary size,
    and so must every token of a bad word. Here the tokenizer knows 512 tokens and the
    model draws 400: "fox" tokenizes to [74, 474]."""
    small = ModelContext(tiny_model_dir("llama", vocab_pad=-112), "tiny")
    assert small.vocab_size == 400 < small.tokenizer.vocab_size
    for p in _both(small, {"allowed_token_ids": [5, 399], "logit_bias": {"399": 1},
                           "bad_words": ["the"]}):
        assert p.allowed_token_ids == [5, 399] and p.logit_bias == {399: 1.0}
    for extra, words in (
            ({"allowed_token_ids": [5, 400]}, "allowed_token_ids contains out-of-vocab"),
            ({"logit_bias": {"400": 1}}, r"token_id\(s\) \[400\] in logit_bias contain "
                                         "out-of-vocab token ids. Vocabulary size: 400"),
            ({"bad_words": ["fox"]}, r"The model vocabulary size is 400, but the following "
                                     r"tokens were specified as bad: \[474, 474\]")):
        with pytest.raises(InvalidRequest, match=words):
            parse_completion({"prompt": "hi"} | extra, small)
        with pytest.raises(InvalidRequest, match=words):
            parse_chat({"messages": MSGS} | extra, small)


def test_logit_bias_is_clamped_to_100(ctx: ModelContext) -> None:
    """vLLM's SamplingParams.from_optional clamps each bias to [-100, 100], the OpenAI
    range; a key that is no token id, or a bias that is no number, is a 400. The clamp
    is SamplingParams' own, so a gRPC request's biases mean what an HTTP request's do."""
    for p in _both(ctx, {"logit_bias": {"47": 150, "5": -1e9, "6": 2.5}}):
        assert p.logit_bias == {47: 100.0, 5: -100.0, 6: 2.5}
    for bias in ({"x": 1}, {"5": "high"}, {"5": float("nan")}):
        with pytest.raises(InvalidRequest, match="logit_bias"):
            parse_completion({"prompt": "hi", "logit_bias": bias}, ctx)
    wire = pb.SamplingParams(logit_bias={47: 150.0, 5: float("-inf"), 6: 2.5})
    p = sampling_from_proto(wire)
    assert p.logit_bias == {47: 100.0, 5: -100.0, 6: 2.5}
    p.validate(ctx.vocab_size)
    with pytest.raises(ValueError, match="logit_bias values must be numbers"):
        sampling_from_proto(pb.SamplingParams(logit_bias={5: float("nan")})).validate()


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
    # An explicit null is no default of 16 to vLLM (CompletionRequest.max_tokens: None):
    # the rest of the context, as on chat.
    assert parse_completion({"prompt": [5] * 10, "max_tokens": None},
                            ctx)[0].params.max_tokens == limit - 10
    assert parse_chat({"messages": MSGS}, ctx).params.max_tokens == \
        limit - len(parse_chat({"messages": MSGS}, ctx).prompt_token_ids)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_prompt_logprobs(ctx: ModelContext, chat: bool) -> None:
    """vLLM's prompt_logprobs (protocol.py, serving_completion/serving_chat): per prompt
    token, null for the first, else {token id: {logprob, rank, decoded_token}}: the
    prompt token first with its rank among all tokens, then the top k ranked 1..k; -inf
    as -9999. On each completions choice, at the top of a chat response."""
    body: dict[str, Any] = {"max_tokens": 2, "prompt_logprobs": 1}
    inp = parse_chat(body | {"messages": MSGS}, ctx) if chat else \
        parse_completion(body | {"prompt": "hi there"}, ctx)[0]
    assert inp.params.prompt_logprobs == 1 and inp.params.logprobs is None
    ids = inp.prompt_token_ids
    top = pb.TopLogprob(token_id=7, logprob=-0.5)
    plp = [pb.TokenLogprob(token_id=t, logprob=-2.0 if i else float("-inf"), rank=3 + i,
                           top=[top]) for i, t in enumerate(ids[1:])]
    choices = Choices([inp], ResponseBuilder("tiny", chat=chat),
                      lambda t: ctx.tokenizer.decode(t, False))
    choices.add(0, pb.WorkerGenerateResponse(token_ids=[5, 6], text="ab", finish_reason="length",
                                             num_output_tokens=2, prompt_logprobs=plp))
    full = choices.full()
    got = full["prompt_logprobs"] if chat else full["choices"][0]["prompt_logprobs"]
    seven = {"logprob": -0.5, "rank": 1, "decoded_token": ctx.tokenizer.decode([7], False)}
    assert got[0] is None and len(got) == len(ids)
    for i, (t, entry) in enumerate(zip(ids[1:], got[1:], strict=True)):
        assert list(entry) == [str(t), "7"]
        assert entry[str(t)] == {"logprob": -2.0 if i else -9999.0, "rank": 3 + i,
                                 "decoded_token": ctx.tokenizer.decode([t], False)}
        assert entry["7"] == seven


def test_prompt_logprobs_values(ctx: ModelContext) -> None:
    """Echo with logprobs asks for the prompt's (vLLM's to_sampling_params); an explicit
    prompt_logprobs wins; streaming refuses it (above 0); vLLM's range."""
    echo = parse_completion({"prompt": "hi", "echo": True, "logprobs": 2}, ctx)[0].params
    assert echo.prompt_logprobs == 2
    given = parse_completion({"prompt": "hi", "echo": True, "logprobs": 2,
                              "prompt_logprobs": 0}, ctx)[0].params
    assert given.prompt_logprobs == 0
    assert parse_completion({"prompt": "hi", "stream": True, "prompt_logprobs": 0},
                            ctx)[0].params.prompt_logprobs == 0
    for extra, words in (({"stream": True, "prompt_logprobs": 1}, "stream=True"),
                         ({"prompt_logprobs": -2}, "positive value or -1"),
                         ({"prompt_logprobs": 21}, "greater than max allowed: 20"),
                         ({"prompt_logprobs": -1}, "greater than max allowed: 20")):
        with pytest.raises(InvalidRequest, match=words):
            parse_completion({"prompt": "hi"} | extra, ctx)
        with pytest.raises(InvalidRequest, match=words):
            parse_chat({"messages": MSGS} | extra, ctx)


def test_chat_echo(ctx: ModelContext) -> None:
    """vLLM's chat `echo` (serving_chat.py): the last message's content goes before the
    reply when its role is the reply's (the assistant's with add_generation_prompt,
    else the last message's own); streamed, one content chunk per choice after the
    role chunks."""
    b = ResponseBuilder("tiny", chat=True)
    gen = pb.WorkerGenerateResponse(token_ids=[5], text=" there", finish_reason="length",
                                    num_output_tokens=1)
    cases = (({"messages": MSGS, "echo": True}, ""),  # the reply's role is the assistant's
             ({"messages": MSGS, "echo": True, "add_generation_prompt": False}, "hi"),
             ({"messages": [*MSGS, {"role": "assistant", "content": "Sure,"}], "echo": True,
               "add_generation_prompt": False, "continue_final_message": True}, "Sure,"),
             ({"messages": MSGS, "add_generation_prompt": False}, ""))
    for body, echoed in cases:
        inp = parse_chat(body, ctx)
        choices = Choices([inp], b, lambda t: ctx.tokenizer.decode(t, False))
        choices.add(0, gen)
        assert choices.full()["choices"][0]["message"]["content"] == echoed + " there"
        chunks = choices.echo_chunks()
        assert [c["choices"][0]["delta"] for c in chunks] == \
            ([{"content": echoed}] if echoed else [])


def test_chat_echo_asks_for_the_prompts_logprobs(ctx: ModelContext) -> None:
    """vLLM's ChatCompletionRequest.to_sampling_params: with `echo` and no
    prompt_logprobs, the prompt's logprobs are asked for with top_logprobs (0 when
    unset); an explicit prompt_logprobs wins. The chat response always carries
    `prompt_logprobs` (ChatCompletionResponse's field), null when none were asked for."""
    def params(extra: dict[str, Any]) -> Any:
        return parse_chat({"messages": MSGS} | extra, ctx).params

    assert params({"echo": True}).prompt_logprobs == 0
    assert params({"echo": True, "stream": True}).prompt_logprobs == 0
    echoed = params({"echo": True, "logprobs": True, "top_logprobs": 3})
    assert (echoed.prompt_logprobs, echoed.logprobs) == (3, 3)
    assert params({"echo": True, "logprobs": True, "top_logprobs": 3,
                   "prompt_logprobs": 1}).prompt_logprobs == 1
    assert params({"logprobs": True, "top_logprobs": 3}).prompt_logprobs is None
    for body, asked in (({"echo": True, "add_generation_prompt": False}, True), ({}, False)):
        inp = parse_chat({"messages": MSGS} | body, ctx)
        ids = inp.prompt_token_ids
        plp = [pb.TokenLogprob(token_id=t, logprob=-1.0, rank=2) for t in ids[1:]]
        choices = Choices([inp], ResponseBuilder("tiny", chat=True),
                          lambda t: ctx.tokenizer.decode(t, False))
        choices.add(0, pb.WorkerGenerateResponse(token_ids=[5], text=" x", num_output_tokens=1,
                                                 finish_reason="length",
                                                 prompt_logprobs=plp if asked else []))
        full = choices.full()
        assert "prompt_logprobs" in full
        if not asked:
            assert full["prompt_logprobs"] is None
            continue
        assert full["choices"][0]["message"]["content"] == "hi x"
        got = full["prompt_logprobs"]
        assert got[0] is None and len(got) == len(ids)
        assert [list(e) for e in got[1:]] == [[str(t)] for t in ids[1:]]  # no top tokens
        assert all(e[str(t)]["logprob"] == -1.0 and e[str(t)]["rank"] == 2
                   for e, t in zip(got[1:], ids[1:], strict=True))


def test_any_int64_seed(ctx: ModelContext) -> None:
    """vLLM takes any 64-bit seed (protocol.py: ge/le of torch.long), -1 meaning none
    (SamplingParams.__post_init__); a negative seed is as reproducible as any other."""
    assert parse_completion({"prompt": "hi", "seed": -1}, ctx)[0].params.seed is None
    for seed in (-5, -2**63, 2**63 - 1, 0):
        p = parse_completion({"prompt": "hi", "seed": seed}, ctx)[0].params
        assert p.seed is not None and 0 <= p.seed < 2**63
        assert p.seed == parse_chat({"messages": MSGS, "seed": seed}, ctx).params.seed
    assert parse_completion({"prompt": "hi", "seed": -5}, ctx)[0].params.seed != \
        parse_completion({"prompt": "hi", "seed": 5}, ctx)[0].params.seed
    for seed in (2**63, -2**63 - 1):
        with pytest.raises(InvalidRequest, match="seed"):
            parse_completion({"prompt": "hi", "seed": seed}, ctx)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_is_per_choice(ctx: ModelContext, chat: bool) -> None:
    """vLLM's continuous_usage_stats: each chunk's usage is its own choice's (its prompt,
    its tokens so far; 0 on the role chunks), the closing usage chunk the sum."""
    body: dict[str, Any] = {"max_tokens": 4, "n": 2, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}}
    inp = parse_chat(body | {"messages": MSGS}, ctx) if chat else \
        parse_completion(body | {"prompt": "hi there"}, ctx)[0]
    n_prompt = len(inp.prompt_token_ids)
    choices = Choices([inp], ResponseBuilder("tiny", chat=chat),
                      lambda t: ctx.tokenizer.decode(t, False))
    first = choices.add(0, pb.WorkerGenerateResponse(index=0, token_ids=[5, 6], text="ab",
                                                     num_output_tokens=2))
    if chat:
        assert [choices.opening(i)["usage"]["completion_tokens"] for i in (0, 1)] == [0, 0]
    other = choices.add(0, pb.WorkerGenerateResponse(index=1, token_ids=[7], text="c",
                                                     num_output_tokens=1))
    for d, want in ((first, 2), (other, 1)):
        u = choices.chunk(d)["usage"]
        assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == \
            (n_prompt, want, n_prompt + want)
    assert choices.usage()[:2] == (n_prompt, 3)


def test_repetition_penalty_above_two(ctx: ModelContext) -> None:
    """vLLM's _verify_args wants a finite repetition_penalty above 0, no upper bound."""
    for value in (2.5, 10):
        for p in _both(ctx, {"repetition_penalty": value}):
            assert p.repetition_penalty == value
            p.validate(ctx.vocab_size)
    for value in (0, -1, 1e400):
        with pytest.raises(InvalidRequest, match="repetition_penalty"):
            parse_completion({"prompt": "hi", "repetition_penalty": value}, ctx)


def test_truncate_prompt_tokens_keeps_the_tokenizers_special_tokens(ctx: ModelContext) -> None:
    """vLLM truncates a text prompt in the tokenizer call (truncation=True, max_length=k,
    left side): the tokens the tokenizer adds (BOS) stay, the text's last tokens fill
    the rest, as transformers' tokenizer gives them. Token-id prompts: their last k."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir("llama"), truncation_side="left")
    text = "hello world foo bar baz"
    for k in (2, 3, 7):
        want = hf(text, truncation=True, max_length=k).input_ids
        got = parse_completion({"prompt": text, "truncate_prompt_tokens": k}, ctx)[0]
        assert got.prompt_token_ids == want and want[0] == hf.bos_token_id
        plain = parse_completion({"prompt": text, "truncate_prompt_tokens": k,
                                  "add_special_tokens": False}, ctx)[0]
        assert plain.prompt_token_ids == hf(text, truncation=True, max_length=k,
                                            add_special_tokens=False).input_ids
    ids = hf(text).input_ids
    assert parse_completion({"prompt": ids, "truncate_prompt_tokens": 3},
                            ctx)[0].prompt_token_ids == ids[-3:]
