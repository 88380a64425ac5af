"""Structured outputs and tools through a real disaggregated cluster: redis-server, a
prefill worker, a decode worker and the gateway as processes (`splitserve up`'s
launcher), every prompt prefilled remotely. The first token is sampled on the prefill
worker under the grammar's mask, the decode continues the grammar from it; a random-
weight model's outputs obey their constraints only because of that. Bad grammars are
400s with xgrammar's message; tools forced by tool_choice come back as tool_calls, over
HTTP (whole and streamed) and gRPC."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import jsonschema
import pytest

from cluster.launcher import ClusterSpec, LocalCluster
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from tests.factories import tiny_model_dir
from tests.integration.serving_util import call_http, load_report, metric, wait_for

NUM_BLOCKS = 256
ALWAYS_REMOTE = ("routing:\n  scorers: [{name: queue, weight: 1.0}]\n  picker: max_score\n"
                 "  decider: {name: threshold, threshold: 0}\n")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "ok", "kind", "n"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Tokyo"]}, "days": {"type": "integer", "minimum": 1,
                                                       "maximum": 7}},
        "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("structured")
    profile = tmp / "routing.yaml"
    profile.write_text(ALWAYS_REMOTE)
    spec = ClusterSpec(model_dir=tiny_model_dir("llama"), num_prefill=1, num_decode=1,
                       num_colocated=0, transport="tcp",
                       worker_args=("--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "64"),
                       gateway_args=("--routing", str(profile)), ready_timeout_s=150,
                       log_dir=str(tmp / "logs"))
    with LocalCluster(spec) as c:
        yield c


def child(cluster: LocalCluster, name: str):
    return next(c for c in cluster.children if c.name == name)


def post(cluster: LocalCluster, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, out, _ = call_http(cluster.http_port, "POST", path, body)
    return status, out


def sse_events(cluster: LocalCluster, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, raw, _ = call_http(cluster.http_port, "POST", path, body | {"stream": True})
    assert status == 200, raw
    events = [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def many(cluster: LocalCluster, bodies: list[dict[str, Any]], path: str = "/v1/completions",
         ) -> list[tuple[int, Any]]:
    with ThreadPoolExecutor(16) as ex:
        return list(ex.map(lambda b: post(cluster, path, b), bodies))


def test_json_schema_outputs_validate_through_remote_prefill(cluster) -> None:
    decode_metrics = int(child(cluster, "decode-0").extra["metrics_port"])
    before = metric(decode_metrics, "splitserve:remote_prefill_total", outcome="ok")
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    bodies = [{"prompt": [1 + i, 2 + i, 3 + i], "max_tokens": 300, "temperature": 1.0,
               "seed": i, "response_format": fmt} for i in range(50)]
    for status, out in many(cluster, bodies):
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)
    assert metric(decode_metrics, "splitserve:remote_prefill_total", outcome="ok") \
        == before + len(bodies)


def test_regex_and_choice_hold_from_the_first_token(cluster) -> None:
    """The first token comes from the prefill worker: were it unmasked, the decode's
    matcher would reject it and the request would fail."""
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    choices = ["yes", "no", "maybe later"]
    bodies = [{"prompt": [7, 8, 9 + i], "max_tokens": 30, "seed": i,
               **({"guided_regex": pattern} if i % 2 else {"guided_choice": choices})}
              for i in range(16)]
    outs = many(cluster, bodies)
    for i, (status, out) in enumerate(outs):
        assert status == 200, out
        text = out["choices"][0]["text"]
        assert re.fullmatch(pattern, text) if i % 2 else text in choices, text
    # Chat, streamed, with vLLM's structured_outputs spelling.
    events = sse_events(cluster, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Pick one"}], "max_tokens": 20,
        "structured_outputs": {"choice": choices}, "seed": 3})
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text in choices and events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_xgrammar_cannot_compile_is_400_with_its_message(cluster, stream) -> None:
    bad = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}
    status, out = post(cluster, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "b",
                                                                    "schema": bad}}})
    assert status == 400 and "missing" in out["error"]["message"], out
    status, out = post(cluster, "/v1/completions", {"prompt": "x", "max_tokens": 5,
                                                     "guided_regex": "a(b"})
    assert status == 400 and "parenthesis" in out["error"]["message"], out


def test_tool_choice_required_forces_calls_that_parse(cluster) -> None:
    body = {"messages": [{"role": "user", "content": "Weather in Paris and the time?"}],
            "tools": [WEATHER, CLOCK], "tool_choice": "required", "max_tokens": 480,
            "temperature": 1.0}
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    # A random model rarely closes an open-ended array; one call (maxItems 1) ends sooner.
    bodies = [body | {"seed": s, "parallel_tool_calls": s < 2} for s in range(6)]
    for status, out in many(cluster, bodies, "/v1/chat/completions"):
        assert status == 200, out
        choice = out["choices"][0]
        msg = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and msg["content"] == "", choice
        assert msg["tool_calls"]
        for call in msg["tool_calls"]:
            assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                params[call["function"]["name"]])
    # Named: the function's arguments, streamed as vLLM does (id/type/name first).
    events = sse_events(cluster, "/v1/chat/completions", body | {
        "seed": 1, "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    deltas = [e["choices"][0]["delta"] for e in events[1:]]
    first = deltas[0]["tool_calls"][0]
    assert set(first) == {"id", "type", "index", "function"}
    assert first["function"]["name"] == "get_time"
    args = "".join(d["tool_calls"][0]["function"].get("arguments", "")
                   for d in deltas if d.get("tool_calls"))
    jsonschema.validate(json.loads(args), CLOCK["function"]["parameters"])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_grpc_generate_returns_tool_calls(cluster) -> None:
    async def call() -> list[pb.GenerateResponse]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
            req = pb.GenerateRequest(
                chat=pb.ChatMessages(messages=[
                    pb.ChatMessage(role="user", content="Weather?"),
                    pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(
                        id="call_0", type="function", name="get_time",
                        arguments='{"tz": "UTC"}')]),
                    pb.ChatMessage(role="tool", tool_call_id="call_0", content="12:00")]),
                sampling=pb.SamplingParams(max_tokens=400, temperature=1.0, seed=5),
                tools_json=json.dumps([WEATHER, CLOCK]), tool_choice_json='"required"')
            return [r async for r in pb_grpc.GenerateStub(ch).Generate(req, timeout=60)]

    resps = asyncio.run(call())
    last = resps[-1]
    assert last.finish_reason == "tool_calls" and last.tool_calls, last
    names = {"get_weather", "get_time"}
    assert all(c.name in names and c.id.startswith("chatcmpl-tool-") for c in last.tool_calls)
    text = "".join(r.text for r in resps)
    assert [c.name for c in last.tool_calls] == [c["name"] for c in json.loads(text)]


def test_every_block_is_free_afterwards(cluster) -> None:
    def free() -> bool:
        reps = [load_report(child(cluster, n).grpc_address) for n in ("prefill-0", "decode-0")]
        return all(r.num_free_blocks == r.num_blocks == NUM_BLOCKS and r.num_active == 0
                   for r in reps)
    wait_for(free, 10, "every block free on both workers")
