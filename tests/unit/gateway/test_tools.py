"""Tools and structured outputs at the gateway, without workers: tool calls parsed out of
model text per family (hermes, llama3_json), streamed as vLLM's deltas (golden files),
the schemas tool_choice forces, tool messages through the chat template (the same text
as transformers), and the structured-output spellings with their 400s."""

from __future__ import annotations

import json
import os
from typing import Any

import jsonschema
import pytest

from gateway.choices import Choices
from gateway.errors import InvalidRequest
from gateway.openai_format import ResponseBuilder, sse
from gateway.protocol import ModelContext, parse_chat, parse_completion
from gateway.tools import ChatOutput, ToolChoice, forced_structure, parse_tools
from protos import splitserve_pb2 as pb
from tests.factories import tiny_model_dir

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Tokyo"]}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def ctx() -> ModelContext:
    return ModelContext(tiny_model_dir("llama"), "tiny", max_model_len=512)


def auto(parser: str, parallel: bool = True) -> ToolChoice:
    return ToolChoice((WEATHER, TIME), "auto", parallel=parallel, parser=parser)


# -- parsing model text -------------------------------------------------------------------

@pytest.mark.parametrize("parser,text,content,calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 2}}\n</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Paris", "days": 2})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"tz": "a}b\\"{"}}</tool_call>'
               '<tool_call>{"arguments": {}, "name": "get_weather"}</tool_call>',
     None, [("get_time", {"tz": 'a}b"{'}), ("get_weather", {})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Tokyo", "days": 1}}; '
                    '{"name": "get_time", "parameters": {}}',
     None, [("get_weather", {"city": "Tokyo", "days": 1}), ("get_time", {})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}', None,
     [("get_time", {"tz": "UTC"})]),
])
def test_calls_are_parsed_out_of_the_models_format(parser, text, content, calls) -> None:
    got_content, got, finish = ChatOutput(auto(parser)).message(text, "stop")
    assert got_content == content and finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] \
        == calls
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in got)
    assert len({c["id"] for c in got}) == len(got)


@pytest.mark.parametrize("parser,text", [
    ("hermes", "Just text, no call."),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'),  # cut off
    ("hermes", "<tool_call>not json</tool_call>"),
    ("llama3_json", "Sure: {\"name\": \"get_time\", \"parameters\": {}}"),  # not at the start
    ("llama3_json", '{"name": "get_time", "parameters": {"tz": }}'),
])
def test_text_without_a_valid_call_is_content(parser, text) -> None:
    assert ChatOutput(auto(parser)).message(text, "length") == (text, [], "length")


@pytest.mark.parametrize("parser,text", [
    ("llama3_json", '{abc "not a call'), ("hermes", "Hi <tool_call>{oops"),
    ("llama3_json", "plain words"), ("hermes", "plain <tool_ words"),
])
def test_a_stream_without_a_call_sends_all_its_text_as_content(parser, text) -> None:
    deltas = _stream(ChatOutput(auto(parser)), [text[i:i + 2] for i in range(0, len(text), 2)])
    assert "".join(d.get("content", "") for d, _ in deltas if d) == text
    assert not any("tool_calls" in d for d, _ in deltas if d)
    assert deltas[-1][1] == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {}}'
    _, calls, _ = ChatOutput(auto("llama3_json", parallel=False)).message(text, "stop")
    assert [c["function"]["name"] for c in calls] == ["get_time"]


def _stream(out: ChatOutput, pieces: list[str]) -> list[tuple[Any, Any]]:
    got = [out.stream(p, None) for p in pieces[:-1]]
    return got + [out.stream(pieces[-1], "stop")]


@pytest.mark.parametrize("parser,text", [
    ("hermes", 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
               '"days": 3}}</tool_call><tool_call>{"name": "get_time", "arguments": '
               '{"tz": "CET"}}</tool_call>'),
    ("llama3_json", '  {"name": "get_weather", "parameters": {"city": "Paris", "days": 3}};'
                    '{"name": "get_time", "parameters": {"tz": "CET"}}'),
])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_deltas_add_up_to_the_whole_response(parser, text, size) -> None:
    """Whatever the delta boundaries: content, then each call's id/type/name once, then
    its argument text; the pieces concatenate to what the whole response holds."""
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    deltas = _stream(ChatOutput(auto(parser)), pieces)
    assert deltas[-1][1] == "tool_calls"
    content = "".join(d.get("content", "") for d, _ in deltas if d)
    calls: dict[int, dict[str, Any]] = {}
    for d, _ in deltas:
        for tc in (d or {}).get("tool_calls", []):
            assert set(tc) in ({"index", "function"}, {"id", "type", "index", "function"})
            c = calls.setdefault(tc["index"], {"args": ""})
            if "id" in tc:
                assert "name" not in c and tc["type"] == "function"
                c["id"], c["name"] = tc["id"], tc["function"]["name"]
            else:
                assert set(tc["function"]) == {"arguments"}
            c["args"] += tc["function"].get("arguments", "")
    whole_content, whole, _ = ChatOutput(auto(parser)).message(text, "stop")
    assert content == (whole_content or "")
    assert [(c["name"], json.loads(c["args"])) for c in calls.values()] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole]


def _normalize(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: ("<id>" if k == "id" else 0 if k == "created" else _normalize(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_normalize(v) for v in obj]
    return obj


# The text deltas of a worker: the llama3_json call arrives in five pieces.
PIECES = ['{"name": "get_', 'weather", ', '"parameters": {"city": ', '"Paris", "days": 3',
          "}}"]


def _render(ctx: ModelContext, stream: bool) -> Any:
    inp = parse_chat({"messages": USER, "tools": [WEATHER, TIME], "stream": stream,
                      "max_tokens": 40}, ctx)
    b = ResponseBuilder("tiny", chat=True)
    choices = Choices([inp], b, lambda ids: ctx.tokenizer.decode(ids, False))
    frames = [sse(b.chunk("", None, first=True))]
    for i, text in enumerate(PIECES):
        last = i == len(PIECES) - 1
        r = pb.WorkerGenerateResponse(text=text, token_ids=[5], num_output_tokens=i + 1,
                                      finish_reason="stop" if last else "")
        chunk = choices.chunk(choices.add(0, r))
        if chunk is not None:
            frames.append(sse(chunk))
    if not stream:
        return _normalize(choices.full())
    return [_normalize(json.loads(f[6:])) for f in frames]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_tool_call_responses_match_vllm_golden_files(ctx, stream) -> None:
    got = _render(ctx, stream)
    with open(os.path.join(GOLDEN, f"chat_tools_{'stream' if stream else 'full'}.json")) as f:
        assert got == json.load(f)


def test_named_and_required_calls_read_the_forced_output() -> None:
    named = ToolChoice((WEATHER, TIME), "named", name="get_weather")
    args = '{"city": "Tokyo", "days": 2}'
    content, calls, finish = ChatOutput(named).message(args, "stop")
    assert content == "" and finish == "stop" and calls[0]["function"] == {
        "name": "get_weather", "arguments": args}
    (d, f), = _stream(ChatOutput(named), [args])
    assert f == "tool_calls" and d["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                   "arguments": args}
    required = ToolChoice((WEATHER, TIME), "required")
    text = '[{"name": "get_time", "parameters": {"tz": "UTC"}}, ' \
           '{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}]'
    content, calls, finish = ChatOutput(required).message(text, "stop")
    assert content == "" and finish == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"tz": "UTC"}, {"city": "Paris", "days": 1}]


def test_forced_schemas_accept_calls_and_only_calls() -> None:
    _, spec = forced_structure(ToolChoice((WEATHER, TIME), "required"))
    schema = json.loads(spec.spec)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "nope", "parameters": {}}],
                [{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    _, one = forced_structure(ToolChoice((WEATHER, TIME), "required", parallel=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, json.loads(one.spec))
    _, named = forced_structure(ToolChoice((WEATHER, TIME), "named", name="get_weather"))
    assert json.loads(named.spec) == WEATHER["function"]["parameters"]
    assert forced_structure(ToolChoice((WEATHER,), "auto")) is None


@pytest.mark.parametrize("tools,choice,words", [
    (None, "required", "`tools` must be set"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "does not match"),
    ([WEATHER], "sometimes", "Invalid value for `tool_choice`"),
    ([{"type": "function", "function": {"description": "no name"}}], None, "name"),
    ("get_weather", None, "`tools` must be a list"),
])
def test_bad_tools_are_400(tools, choice, words) -> None:
    with pytest.raises(InvalidRequest, match=words):
        parse_tools(tools, choice, None)


def test_tool_choice_turns_into_the_constraint_and_parser(ctx) -> None:
    body = {"messages": USER, "tools": [WEATHER, TIME], "max_tokens": 8}
    inp = parse_chat(body, ctx)
    assert inp.tools is not None and inp.tools.mode == "auto"
    assert inp.tools.parser == "llama3_json" and inp.params.structured is None
    inp = parse_chat(body | {"tool_choice": "required"}, ctx)
    assert inp.params.structured is not None and inp.params.structured.kind == "json_schema"
    with pytest.raises(InvalidRequest, match="only use one kind"):
        parse_chat(body | {"tool_choice": "required",
                           "response_format": {"type": "json_object"}}, ctx)
    none = ModelContext(tiny_model_dir("llama"), "tiny", tool_call_parser="none")
    with pytest.raises(InvalidRequest, match="tool-call-parser"):
        parse_chat(body, none)
    assert parse_chat(body | {"tool_choice": "none"}, none).params.structured is None


def test_tools_and_tool_messages_render_as_transformers_does(ctx) -> None:
    """The conversation of a tool round trip, through our template path and through
    transformers' apply_chat_template (the reference), gives the same prompt."""
    import transformers

    msgs = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    inp = parse_chat({"messages": msgs, "tools": [WEATHER], "max_tokens": 4}, ctx)
    d = tiny_model_dir("llama")
    hf = transformers.AutoTokenizer.from_pretrained(d)
    ref_msgs = [dict(m) for m in msgs]
    ref_msgs[1] = {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}]}
    ref = hf.apply_chat_template(ref_msgs, tools=[WEATHER], add_generation_prompt=True,
                                 tokenize=False)
    assert ctx.tokenizer.decode(inp.prompt_token_ids, False) == ref
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}' in ref
    assert "sunny, 21 C" in ref and '"description": "Weather of a city"' in ref


# -- structured-output spellings ---------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("extra,kind,spec", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}}, "json_schema", json.dumps(SCHEMA)),
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "text"}}, None, None),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", json.dumps(SCHEMA)),
    ({"structured_outputs": {"grammar": 'root ::= "a"', "disable_fallback": True}},
     "grammar", 'root ::= "a"'),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, "json_schema",
     json.dumps(SCHEMA)),
    ({"guided_regex": "a+"}, "regex", "a+"),
    ({"guided_grammar": 'root ::= "b"'}, "grammar", 'root ::= "b"'),
])
def test_every_spelling_reaches_one_constraint(ctx, extra, kind, spec) -> None:
    for inp in (parse_completion({"prompt": "x", "max_tokens": 4} | extra, ctx)[0],
                parse_chat({"messages": USER, "max_tokens": 4} | extra, ctx)):
        s = inp.params.structured
        assert (s.kind, s.spec) == (kind, spec) if kind else s is None


def test_choice_spellings(ctx) -> None:
    for extra in ({"guided_choice": ["yes", "no"]},
                  {"structured_outputs": {"choice": ["yes", "no"]}}):
        s = parse_completion({"prompt": "x", "max_tokens": 4} | extra, ctx)[0].params.structured
        assert s is not None and (s.kind, s.choices) == ("choice", ("yes", "no"))


@pytest.mark.parametrize("extra,words", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "only use one kind"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "only use one kind"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "only use one kind"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"response_format": {"type": "structural_tag"}}, "not supported"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_json": "{not json"}, "not valid JSON"),
    ({"guided_choice": []}, "non-empty list"),
    ({"guided_decoding_backend": "outlines"}, "xgrammar"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "whitespace_pattern"),
    ({"structural_tag": "{}"}, "structural_tag"),
])
def test_conflicting_or_bad_constraints_are_400(ctx, extra, words) -> None:
    with pytest.raises(InvalidRequest, match=words):
        parse_completion({"prompt": "x", "max_tokens": 4} | extra, ctx)
