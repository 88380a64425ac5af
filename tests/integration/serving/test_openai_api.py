"""The OpenAI surface of the shared cluster (conftest.py): the OpenAI SDK and raw HTTP
against /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics;
greedy text as the offline engine's; echo, logprobs against transformers, prompt lists,
n and seeds; request ids and cached-token counts."""

from __future__ import annotations

import time

import openai

from engine.sampling_params import SamplingParams
from tests.factories import hf_model
from tests.integration.serving.shared import MAX_MODEL_LEN, workers
from tests.integration.serving_util import call_http, load_report, metric, wait_for


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="none",
                         timeout=60, max_retries=0)


def test_openai_sdk_completions(cluster, model, offline) -> None:
    c = client(cluster)
    r = c.completions.create(model=model, prompt="The quick brown fox", max_tokens=8,
                             temperature=0)
    ref = offline.generate("The quick brown fox", SamplingParams(max_tokens=8, temperature=0))
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref[0].text
    assert r.choices[0].finish_reason == ref[0].finish_reason
    assert r.usage.completion_tokens == len(ref[0].token_ids)
    assert r.usage.prompt_tokens_details.cached_tokens is not None
    chunks = list(c.completions.create(model=model, prompt="The quick brown fox", max_tokens=8,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref[0].text
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_openai_sdk_chat(cluster, model, offline) -> None:
    c = client(cluster)
    msgs = [{"role": "user", "content": "Hello, how are you today?"}]
    ids = offline.tokenizer.encode_chat(msgs)
    ref = offline.generate([ids], SamplingParams(max_tokens=10, temperature=0))[0]
    r = c.chat.completions.create(model=model, messages=msgs, max_completion_tokens=10,
                                  temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(c.chat.completions.create(model=model, messages=msgs, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens is not None


def test_cached_tokens_reported(cluster, model) -> None:
    prompt = " ".join(["The five boxing wizards jump quickly."] * 8)
    c = client(cluster)
    cached = [c.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
              .usage.prompt_tokens_details.cached_tokens for _ in range(3)]
    # Three requests over two workers: at least one repeats on a worker with the prefix.
    assert cached[0] == 0 and max(cached) >= 16, cached


def test_request_id_is_echoed_and_reaches_the_worker(cluster, model) -> None:
    rid = f"trace-{time.time_ns()}"
    for _ in range(2):  # a reused id is fine: the engine gets a unique one
        got, _, headers = call_http(cluster.http_port, "POST", "/v1/completions",
                                    {"prompt": "hello", "max_tokens": 2},
                                    headers={"x-request-id": rid})
        assert got == 200 and headers["x-request-id"] == rid

    def in_worker_log() -> bool:
        return any(rid in w.log_tail(200) for w in workers(cluster))
    wait_for(in_worker_log, 5, "the request id in a worker's log")


def test_endpoints_health_models_metrics(cluster, model) -> None:
    assert call_http(cluster.http_port, "GET", "/health")[0] == 200
    got, payload, _ = call_http(cluster.http_port, "GET", "/v1/models")
    assert got == 200 and payload["data"][0]["id"] == model
    assert payload["data"][0]["max_model_len"] == MAX_MODEL_LEN
    got, text, _ = call_http(cluster.http_port, "GET", "/metrics")
    assert got == 200 and "splitserve:gateway_requests_total" in text
    for pool_series in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                        "vllm:kv_cache_usage_perc"):  # what an endpoint picker scores
        assert f'{pool_series}{{model_name="{model}"}}' in text, pool_series
    for w in workers(cluster):
        port = int(w.extra["metrics_port"])
        assert metric(port, "vllm:num_requests_running") == 0
        assert metric(port, "vllm:prefix_cache_queries_total") >= 0
    total = sum(metric(int(w.extra["metrics_port"]), "vllm:request_success_total")
                for w in workers(cluster))
    assert total > 0


def _prefix_queries(cluster) -> int:
    return sum(load_report(w.grpc_address).prefix_cache_queries for w in workers(cluster))


def test_echo_logprobs_prompt_lists_n_and_seeds_over_http(cluster, model, offline) -> None:
    import torch

    port = cluster.http_port
    prompt = "The five boxing wizards jump quickly over the lazy dog."
    ids = offline.tokenizer.encode(prompt)
    ref_out = offline.generate([ids], SamplingParams(max_tokens=5, temperature=0))[0]
    _, r, _ = call_http(port, "POST", "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True,
        "logprobs": 2})
    choice = r["choices"][0]
    assert choice["text"] == prompt + ref_out.text
    lp = choice["logprobs"]
    every = ids + ref_out.token_ids
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(every) == len(lp["text_offset"])
    with torch.no_grad():  # transformers, the reference
        ref = hf_model(cluster.spec.model_dir)(torch.tensor([every])).logits[0].log_softmax(-1)
    for j in range(1, len(every)):
        assert abs(lp["token_logprobs"][j] - ref[j - 1, every[j]].item()) < 1e-4, j
        top = sorted(lp["top_logprobs"][j].values(), reverse=True)[:2]
        assert all(abs(a - b) < 1e-4 for a, b in zip(top, ref[j - 1].topk(2).values.tolist()))
    # A prompt list: one choice per prompt, in order.
    prompts = ["Pack my box", [5, 17, 300, 41], "How vexingly quick daft zebras jump"]
    _, r, _ = call_http(port, "POST", "/v1/completions", {
        "model": model, "prompt": prompts, "max_tokens": 4, "temperature": 0})
    refs = offline.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["text"] for c in r["choices"]] == [o.text for o in refs]
    # n=4 from one prefill: the workers looked the prompt up once, not four times.
    fresh = [(13 * j) % 470 + 9 for j in range(37)]
    before = _prefix_queries(cluster)
    body = {"model": model, "prompt": fresh, "max_tokens": 6, "temperature": 1.0, "n": 4,
            "seed": 123}
    _, r1, _ = call_http(port, "POST", "/v1/completions", body)
    assert _prefix_queries(cluster) - before == len(fresh)
    _, r2, _ = call_http(port, "POST", "/v1/completions", body)
    texts = [c["text"] for c in r1["choices"]]
    assert [c["index"] for c in r1["choices"]] == [0, 1, 2, 3] and len(set(texts)) > 1
    assert [c["text"] for c in r2["choices"]] == texts  # seeded: reproducible
    seeded = offline.generate([fresh], SamplingParams(max_tokens=6, temperature=1.0, n=4,
                                                      seed=123))
    assert [o.text for o in seeded] == texts  # and the same on any engine
    assert r1["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in seeded)
