"""vLLM's extra request fields on the shared cluster (conftest.py), with vLLM's effect:
stream_options.continuous_usage_stats (guidellm's streamed body), min_p,
include_stop_str_in_output, return_token_ids, chat_template_kwargs; vLLM's completion
default of 16 tokens."""

from __future__ import annotations

import json
from typing import Any

from engine.sampling_params import SamplingParams
from tests.integration.serving.shared import workers
from tests.integration.serving_util import call_http, metric, ttft_parts, wait_for

PROMPT = "The quick brown fox jumps over"
MSGS = [{"role": "user", "content": "Tell me about foxes."}]


def _events(port: int, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, raw, _ = call_http(port, "POST", path, body | {"stream": True})
    assert status == 200, raw
    lines = [ln[len("data: "):] for ln in raw.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_guidellm_stream_gets_usage_on_every_chunk(cluster, model) -> None:
    # guidellm's streamed request body (its OpenAI HTTP backend).
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MSGS})):
        chunks = _events(cluster.http_port, path, body | {
            "model": model, "max_tokens": 8, "ignore_eos": True, "stream_options": opts})
        assert all(c["usage"] is not None for c in chunks), path
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 8 and counts[0] < 8, counts
        assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"]
                   + c["usage"]["completion_tokens"] for c in chunks)
        assert chunks[-1]["choices"] == []  # include_usage's closing chunk stays
    # Without it, only the closing chunk carries usage (as before).
    chunks = _events(cluster.http_port, "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": 4,
        "stream_options": {"include_usage": True}})
    assert [c["usage"] is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_min_p_one_at_temperature_one_is_greedy(cluster, model, offline) -> None:
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0))[0]
    for seed in (1, 2, 3):
        _, r, _ = call_http(cluster.http_port, "POST", "/v1/completions", {
            "model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0,
            "min_p": 1.0, "seed": seed})
        assert r["choices"][0]["text"] == ref.text
    _, r, _ = call_http(cluster.http_port, "POST", "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 1})
    assert r["choices"][0]["text"] != ref.text  # so that the check above could fail


def test_return_token_ids_are_the_generated_and_prompt_ids(cluster, model, offline) -> None:
    port = cluster.http_port
    ids = offline.tokenizer.encode(PROMPT)
    ref = offline.generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}
    _, r, _ = call_http(port, "POST", "/v1/completions", body)
    assert r["choices"][0]["token_ids"] == ref.token_ids
    assert r["choices"][0]["prompt_token_ids"] == ids
    chunks = _events(port, "/v1/completions", body)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ref.token_ids
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    chat_ids = offline.tokenizer.encode_chat(MSGS)
    chat_ref = offline.generate([chat_ids], SamplingParams(max_tokens=6, temperature=0))[0]
    body = {"model": model, "messages": MSGS, "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}
    _, r, _ = call_http(port, "POST", "/v1/chat/completions", body)
    assert r["prompt_token_ids"] == chat_ids
    assert r["choices"][0]["token_ids"] == chat_ref.token_ids
    chunks = _events(port, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == chat_ids
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] \
        == chat_ref.token_ids
    _, r, _ = call_http(port, "POST", "/v1/completions", body | {"return_token_ids": False,
                                                                  "prompt": PROMPT})
    assert "token_ids" not in r["choices"][0]


def test_include_stop_str_in_output(cluster, model, offline) -> None:
    port = cluster.http_port
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0,
                                                  ignore_eos=True))[0].text
    # A stop string first seen in the middle of the output.
    at = next(i for i in range(3, len(ref) - 3) if ref.find(ref[i:i + 3]) == i
              and ref[i:i + 3].strip())
    stop = ref[at:at + 3]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "stop": [stop]}
    for include, want in ((True, ref[:at + 3]), (False, ref[:at])):
        _, r, _ = call_http(port, "POST", "/v1/completions",
                            body | {"include_stop_str_in_output": include})
        assert r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == "stop"
        assert r["choices"][0]["stop_reason"] == stop  # vLLM's: the matched string
        chunks = _events(port, "/v1/completions", body | {"include_stop_str_in_output": include})
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
        assert [c["choices"][0]["stop_reason"] for c in chunks][-1] == stop


def test_chat_template_kwargs_reach_the_template(cluster, model, offline) -> None:
    # add_generation_prompt through chat_template_kwargs overrides the field, as in vLLM.
    without = offline.tokenizer.encode_chat(MSGS, add_generation_prompt=False)
    assert without != offline.tokenizer.encode_chat(MSGS)
    _, r, _ = call_http(cluster.http_port, "POST", "/v1/chat/completions", {
        "model": model, "messages": MSGS, "max_tokens": 2, "return_token_ids": True,
        "chat_template_kwargs": {"add_generation_prompt": False, "enable_thinking": False}})
    assert r["prompt_token_ids"] == without


def test_completions_without_max_tokens_give_16_tokens(cluster, model) -> None:
    _, r, _ = call_http(cluster.http_port, "POST", "/v1/completions", {
        "model": model, "prompt": PROMPT, "ignore_eos": True})
    assert r["usage"]["completion_tokens"] == 16
    assert r["choices"][0]["finish_reason"] == "length"


def test_tokens_summed_over_every_pod_count_once(cluster, model) -> None:
    ports = [cluster.http_port] + [int(w.extra["metrics_port"]) for w in workers(cluster)]

    def over_pods(name: str) -> float:
        return sum(metric(p, name) for p in ports)

    names = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
             "vllm:request_inference_time_seconds_count", "vllm:iteration_tokens_total_sum",
             "vllm:request_time_per_output_token_seconds_count",
             "vllm:request_decode_time_seconds_sum",
             "vllm:request_time_per_output_token_seconds_sum")
    before = {n: over_pods(n) for n in names}
    prompt = completion = 0
    for i in range(4):
        _, r, _ = call_http(cluster.http_port, "POST", "/v1/completions", {
            "model": model, "prompt": f"{i} counting tokens once", "max_tokens": 5,
            "ignore_eos": True})
        prompt += r["usage"]["prompt_tokens"]
        completion += r["usage"]["completion_tokens"]

    def settled() -> bool:  # a worker counts a request as it ends, just after its reply
        return over_pods("vllm:request_inference_time_seconds_count") \
            == before["vllm:request_inference_time_seconds_count"] + 4
    wait_for(settled, 10, "the workers' request metrics")
    after = {n: over_pods(n) for n in names}
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == prompt
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] \
        == completion
    for n in ("vllm:request_prefill_time_seconds_count",
              "vllm:request_decode_time_seconds_count"):
        assert after[n] - before[n] == 4, n
    # TPOT: each request's decode time over its 4 tokens after the first.
    tpot = {n: after[n] - before[n] for n in names if "decode_time" in n or "per_output" in n}
    assert tpot["vllm:request_time_per_output_token_seconds_count"] == 4
    assert abs(tpot["vllm:request_time_per_output_token_seconds_sum"]
               - tpot["vllm:request_decode_time_seconds_sum"] / 4) < 1e-6
    # Every token computed in some step: prompts (less cache hits) and outputs (the
    # last output token is sampled, never computed).
    assert 0 < after["vllm:iteration_tokens_total_sum"] \
        - before["vllm:iteration_tokens_total_sum"] <= prompt + completion
    assert metric(ports[0], "splitserve:gateway_generation_tokens_total") >= completion
    assert all(metric(p, "vllm:cache_config_info", block_size="16") == 1 for p in ports[1:])


def test_ttft_breakdown_header_on_plain_and_streamed_responses(cluster, model) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3}
    port = cluster.http_port
    before = {part: metric(port, "splitserve:gateway_ttft_part_seconds_count",
                           model_name=model, part=part) for part in ("prefill", "other")}
    for stream in (False, True):
        # Off by default: the breakdown comes back only to a request that asks.
        status, _, headers = call_http(port, "POST", "/v1/completions",
                                       body | {"stream": stream})
        assert status == 200 and "x-splitserve-ttft" not in headers
        status, _, headers = call_http(port, "POST", "/v1/completions",
                                       body | {"stream": stream},
                                       headers={"x-splitserve-ttft": "1"})
        assert status == 200
        ttft = ttft_parts(headers["x-splitserve-ttft"])
        # Colocated: the prefill ran on the worker itself, no KV moved.
        assert set(ttft) == {"queue", "route", "worker_queue", "prefill", "kv_transfer",
                             "total"}, ttft
        assert ttft["kv_transfer"] == 0 and ttft["prefill"] > 0
        assert min(ttft.values()) >= 0
        # The parts fit in the total (the rest: network, gRPC, the gateway's own work).
        assert sum(v for k, v in ttft.items() if k != "total") <= ttft["total"] + 1.0
    # Every request's parts are observed, asked for or not.
    for part, n in before.items():
        assert metric(port, "splitserve:gateway_ttft_part_seconds_count", model_name=model,
                      part=part) - n == 4, part
    status, r, _ = call_http(port, "POST", "/v1/completions", body,
                             headers={"x-splitserve-ttft": "please"})
    assert status == 400 and "x-splitserve-ttft must be 1 or 0" in r["error"]["message"]


def test_disable_any_whitespace_fixes_the_json_layout(cluster, model) -> None:
    """structured_outputs.disable_any_whitespace reaches the worker's grammar: every
    sample is laid out as json.dumps writes it."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99},
                                               "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    for seed in range(4):
        _, r, _ = call_http(cluster.http_port, "POST", "/v1/completions", {
            "model": model, "prompt": PROMPT, "max_tokens": 60, "temperature": 1.0,
            "seed": seed, "structured_outputs": {"json": schema,
                                                 "disable_any_whitespace": True}})
        text = r["choices"][0]["text"]
        assert text == json.dumps(json.loads(text)), text


def test_grpc_defaults_and_stop_reason_match_http(cluster, model, offline) -> None:
    """The gRPC front: 16 tokens without max_tokens for prompt input (as
    /v1/completions), and the stop string that ended a sample as `stop_str`."""
    import grpc

    from protos import splitserve_pb2 as pb
    from protos import splitserve_pb2_grpc as pb_grpc

    ref = offline.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0,
                                                  ignore_eos=True))[0].text
    at = next(i for i in range(3, len(ref) - 3) if ref.find(ref[i:i + 3]) == i
              and ref[i:i + 3].strip())
    stop = ref[at:at + 3]
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        stub = pb_grpc.GenerateStub(ch)
        outs = list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(
            temperature=0, ignore_eos=True)), timeout=60))
        assert outs[-1].usage.completion_tokens == 16 and outs[-1].finish_reason == "length"
        assert outs[-1].WhichOneof("stop_reason") is None
        outs = list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(
            temperature=0, ignore_eos=True, stop=[stop])), timeout=60))
        assert "".join(o.text for o in outs) == ref[:at]
        assert outs[-1].finish_reason == "stop" and outs[-1].stop_str == stop


def test_a_bodys_request_id_is_the_response_id(cluster, model) -> None:
    """vLLM: the response `id` is "cmpl-" / "chatcmpl-" and the request's id (the
    x-request-id header, else the body's `request_id`)."""
    port = cluster.http_port
    _, r, h = call_http(port, "POST", "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": 2, "request_id": "rid-1"})
    assert r["id"] == "cmpl-rid-1" and h["x-request-id"] == "rid-1"
    _, r, _ = call_http(port, "POST", "/v1/chat/completions", {
        "model": model, "messages": MSGS, "max_tokens": 2}, headers={"x-request-id": "rid-2"})
    assert r["id"] == "chatcmpl-rid-2"
