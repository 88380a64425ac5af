"""The request bodies the usual benchmark and evaluation clients send, replayed against
the shared cluster's HTTP server (conftest.py): each must succeed with the shape the
client reads. The bodies are rebuilt from the clients' own request builders:

- guidellm (vllm-project/guidellm, src/guidellm/backends/openai/request_handlers.py,
  TextCompletionsRequestHandler.format): streamed, stream_options {include_usage,
  continuous_usage_stats}, max_tokens with stop null and ignore_eos true;
- `vllm bench serve` (vllm-project/vllm, vllm/benchmarks/lib/endpoint_request_func.py,
  async_request_openai_completions): completions, repetition_penalty 1.0, logprobs
  null, streamed with include_usage, ignore_eos;
- inference-perf (kubernetes-sigs/inference-perf, inference_perf/apis/completion.py,
  CompletionAPIData.to_request_body): model, prompt, max_tokens, ignore_eos, stream, and
  include_usage when streaming;
- lm-eval's local-completions (EleutherAI/lm-evaluation-harness,
  lm_eval/models/openai_completions.py, LocalCompletionsAPI._create_payload): batches of
  token-id prompts; loglikelihood asks echo, logprobs 1, max_tokens 1, temperature 0,
  seed 1234; generation asks max_tokens, temperature 0, stop (the task's `until`), seed.
"""

from __future__ import annotations

import json
from typing import Any

from tests.integration.serving_util import call_http

PROMPT = "The quick brown fox jumps over"


def _stream(port: int, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, raw, _ = call_http(port, "POST", "/v1/completions", body)
    assert status == 200, raw
    lines = [ln[len("data: "):] for ln in raw.split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_guidellm_streamed_completions(cluster, model) -> None:
    chunks = _stream(cluster.http_port, {
        "model": model, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": 12, "stop": None, "ignore_eos": True, "prompt": PROMPT})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all(c["usage"] is not None for c in chunks)
    assert _text(chunks)


def test_vllm_bench_serve_completions(cluster, model) -> None:
    chunks = _stream(cluster.http_port, {
        "model": model, "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 10,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True})
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_inference_perf_completions_streamed_and_not(cluster, model) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    chunks = _stream(cluster.http_port, body | {
        "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and _text(chunks)
    status, r, _ = call_http(cluster.http_port, "POST", "/v1/completions",
                             body | {"stream": False})
    assert status == 200 and r["usage"]["completion_tokens"] == 8 and r["choices"][0]["text"]


def test_lm_eval_local_completions(cluster, model, offline) -> None:
    port = cluster.http_port
    batch = [offline.tokenizer.encode(p) for p in (PROMPT, "Once upon a time")]
    status, r, _ = call_http(port, "POST", "/v1/completions", {
        "model": model, "prompt": batch, "temperature": 0, "max_tokens": 1, "logprobs": 1,
        "seed": 1234, "echo": True})
    assert status == 200, r
    for choice, ids in zip(sorted(r["choices"], key=lambda c: c["index"]), batch, strict=True):
        lps = choice["logprobs"]
        # What parse_logprobs reads: the prompt's tokens then the generated one.
        assert len(lps["token_logprobs"]) == len(ids) + 1 and lps["token_logprobs"][0] is None
        assert all(isinstance(v, float) for v in lps["token_logprobs"][1:])
        assert all(len(top) >= 1 for top in lps["top_logprobs"][1:])
    status, r, _ = call_http(port, "POST", "/v1/completions", {
        "prompt": batch, "model": model, "max_tokens": 8, "temperature": 0,
        "stop": ["\n\n"], "seed": 1234})
    assert status == 200, r
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert all(c["finish_reason"] in ("length", "stop") for c in r["choices"])
