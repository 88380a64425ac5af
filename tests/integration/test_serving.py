"""The serving path with real processes: redis-server, two colocated workers and the
gateway (started by cluster.launcher, as `splitserve up` does), driven over HTTP (the
OpenAI SDK, raw HTTP) and gRPC. One cluster is shared by the module; the test that
kills a worker runs last."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time

import grpc
import openai
import pytest

from cluster.launcher import ClusterSpec, LocalCluster
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from protos import splitserve_pb2 as pb
from protos import splitserve_pb2_grpc as pb_grpc
from tests.factories import hf_greedy, hf_model, tiny_model_dir
from tests.integration.serving_util import (
    call_http,
    grpc_generate,
    load_report,
    metric,
    stream_then_hang_up,
    wait_for,
)

NUM_BLOCKS = 128
MAX_MODEL_LEN = 768  # below the model's 1024: the gateway must learn it from the workers
WORKER_ARGS = ("--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "32",
               "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-batched-tokens", "512", "--log-level", "INFO")
ADMIN_KEY = "serving-admin-key"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spec = ClusterSpec(model_dir=tiny_model_dir("llama"), num_colocated=2,
                       worker_args=WORKER_ARGS, ready_timeout_s=150,
                       gateway_args=("--admin-key", ADMIN_KEY),
                       log_dir=str(tmp_path_factory.mktemp("cluster-logs")))
    c = LocalCluster(spec)
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def model(cluster) -> str:
    return os.path.basename(os.path.normpath(cluster.spec.model_dir))


@pytest.fixture(scope="module")
def offline(cluster) -> LLM:
    return LLM(cluster.spec.model_dir, num_blocks=NUM_BLOCKS, max_num_seqs=32,
               max_num_batched_tokens=512, max_model_len=MAX_MODEL_LEN)


def workers(cluster):
    return [c for c in cluster.children if c.name.startswith("colocated")]


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


def test_greedy_matches_offline_for_concurrent_requests(cluster, model, offline) -> None:
    lengths = [3, 17, 40, 90, 5, 33, 64, 128, 8, 21, 50, 75, 12, 100, 16, 200]
    prompts = [[(7 * i + 13 * j) % 500 + 1 for j in range(n)] for i, n in enumerate(lengths)]
    max_tokens = [4 + (i * 7) % 29 for i in range(len(prompts))]
    ref = offline.generate(prompts, [SamplingParams(max_tokens=m, temperature=0)
                                     for m in max_tokens])

    async def http_all() -> list[str]:
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1",
                               api_key="none", timeout=120, max_retries=0)
        rs = await asyncio.gather(*(c.completions.create(
            model=model, prompt=p, max_tokens=m, temperature=0)
            for p, m in zip(prompts, max_tokens)))
        await c.close()
        return [r.choices[0].text for r in rs]

    assert asyncio.run(grpc_generate(f"127.0.0.1:{cluster.grpc_port}", prompts,
                                     max_tokens)) == [r.token_ids for r in ref]
    assert asyncio.run(http_all()) == [r.text for r in ref]
    # And the offline engine is transformers' greedy generate (spot check 4 prompts).
    hf = hf_model(cluster.spec.model_dir)
    eos = offline.engine.eos_token_ids[0] if offline.engine.eos_token_ids else None
    for i in (0, 3, 7, 15):
        assert hf_greedy(hf, prompts[i], max_tokens[i], eos) == ref[i].token_ids


def test_grpc_generate_errors_and_usage(cluster, model) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        stub = pb_grpc.GenerateStub(ch)
        req = pb.GenerateRequest(request_id="grpc-1", prompt="Once upon a time",
                                 sampling=pb.SamplingParams(max_tokens=6, temperature=0))
        outs = list(stub.Generate(req, timeout=60))
        assert outs[-1].finish_reason in ("length", "stop") and outs[-1].request_id == "grpc-1"
        assert outs[-1].usage.completion_tokens == sum(len(o.token_ids) for o in outs)
        chat = pb.GenerateRequest(chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content="hi")]),
            sampling=pb.SamplingParams(max_tokens=3, temperature=0))
        assert list(stub.Generate(chat, timeout=60))[-1].usage.completion_tokens >= 1
        for bad, code in (
                (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=5000)),
                 grpc.StatusCode.INVALID_ARGUMENT),
                (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_p=0.0)),
                 grpc.StatusCode.INVALID_ARGUMENT),
                (pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=1)),
                 grpc.StatusCode.INVALID_ARGUMENT),
                (pb.GenerateRequest(model="other", prompt="x"), grpc.StatusCode.NOT_FOUND)):
            with pytest.raises(grpc.RpcError) as ei:
                list(stub.Generate(bad, timeout=30))
            assert ei.value.code() == code, ei.value


def test_bad_inputs_get_their_status_and_workers_keep_serving(cluster, model) -> None:
    port = cluster.http_port
    cases = [
        (b"{not json", 400), (b"[1, 2]", 400),
        ({"model": "nope", "prompt": "x"}, 404),
        ({"prompt": "x", "max_tokens": 100_000}, 400),
        ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400),  # the workers' limit
        ({"prompt": "x", "temperature": -0.5}, 400),
        ({"prompt": "x", "top_p": 1.5}, 400),
        ({"prompt": "x", "n": 0}, 400),
        ({"prompt": "x", "suffix": "y"}, 400),  # refused, named
        ({"prompt": "x", "stop": {"a": 1}}, 400),
        ({"prompt": [1, 10_000_000]}, 400),
        (b'{"prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}', 400),
    ]
    for body, status in cases:
        got, payload, _ = call_http(port, "POST", "/v1/completions", body)
        assert got == status, (body if len(str(body)) < 200 else "big body", payload)
        err = payload["error"]
        assert err["code"] == status and err["message"] and "type" in err and "param" in err
    got, payload, _ = call_http(port, "POST", "/v1/chat/completions", {"messages": "hi"})
    assert got == 400 and payload["error"]["type"] == "BadRequestError"
    got, payload, _ = call_http(port, "POST", "/v1/completions",
                                {"model": model, "prompt": "still serving", "max_tokens": 3})
    assert got == 200 and payload["usage"]["completion_tokens"] >= 1


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


def test_grpc_generate_carries_samples_and_logprobs(cluster, model) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 14, 159, 26, 53]),
                                 sampling=pb.SamplingParams(max_tokens=4, temperature=0.7,
                                                            seed=5, n=2, logprobs=1),
                                 echo=True)
        resps = list(pb_grpc.GenerateStub(ch).Generate(req, timeout=30))
    for i in (0, 1):
        mine = [r for r in resps if r.index == i]
        toks = [t for r in mine for t in r.token_ids]
        lps = [lp for r in mine for lp in r.logprobs]
        assert len(toks) == 4 and [lp.token_id for lp in lps] == toks
        assert all(len(lp.top) == 1 for lp in lps)
        assert len(mine[0].prompt_logprobs) == 4  # prompt tokens 1..4
        assert mine[-1].finish_reason == "length"
        assert abs(mine[-1].cumulative_logprob - sum(lp.logprob for lp in lps)) < 1e-4


def test_client_disconnect_frees_every_block(cluster, model) -> None:
    ports = [int(w.extra["metrics_port"]) for w in workers(cluster)]
    aborted = sum(metric(p, "vllm:request_success_total", finished_reason="abort")
                  for p in ports)
    stream_then_hang_up(cluster.http_port, {"prompt": "Once upon a time", "max_tokens": 700,
                                            "ignore_eos": True, "temperature": 0}, events=4)
    # Connection closed mid-stream: the worker must abort and free all its blocks.
    def aborts() -> float:
        return sum(metric(p, "vllm:request_success_total", finished_reason="abort")
                   for p in ports)
    try:
        wait_for(lambda: aborts() >= aborted + 1, 10, "the worker to abort")
    except AssertionError as e:
        logs = "\n".join(c.log_tail(15) for c in cluster.children if c.name != "redis")
        raise AssertionError(f"{e}: aborts {aborted} -> {aborts()}\n{logs}") from None

    def all_free() -> bool:
        reps = [load_report(w.grpc_address) for w in workers(cluster)]
        return all(r.num_free_blocks == r.num_blocks == NUM_BLOCKS and r.num_active == 0
                   and r.num_running == 0 for r in reps)
    wait_for(all_free, 10, "free blocks back to total on every worker")


def test_grpc_deadline_cancels_the_worker_request(cluster, model) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        req = pb.GenerateRequest(prompt="tick tock", sampling=pb.SamplingParams(
            max_tokens=700, ignore_eos=True, temperature=0.0))
        with pytest.raises(grpc.RpcError) as ei:
            list(pb_grpc.GenerateStub(ch).Generate(req, timeout=0.3))
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def all_free() -> bool:
        reps = [load_report(w.grpc_address) for w in workers(cluster)]
        return all(r.num_free_blocks == r.num_blocks and r.num_active == 0 for r in reps)
    wait_for(all_free, 10, "the deadline-cancelled request's blocks to be freed")


def test_gateway_with_a_static_worker_list(cluster, model) -> None:
    from cluster.launcher import free_port

    port = free_port()
    addrs = ",".join(w.grpc_address or "" for w in workers(cluster))
    cluster.spawn("gateway-static", cluster.cli_argv(
        "gateway", "--http-port", str(port), "--workers", addrs,
        "--model", cluster.spec.model_dir))
    wait_for(lambda: _health(port) == 200, 60, "the static-list gateway to be ready", 0.25)
    got, payload, _ = call_http(port, "POST", "/v1/completions",
                                {"prompt": "static", "max_tokens": 3})
    assert got == 200 and payload["usage"]["completion_tokens"] >= 1


def _health(port: int) -> int:
    try:
        return call_http(port, "GET", "/health", timeout=2)[0]
    except OSError:
        return 0


def test_workers_registered_in_redis_with_ttl(cluster, model) -> None:
    import redis

    r = redis.Redis.from_url(cluster.redis_url, socket_timeout=2, decode_responses=True)
    alive = workers(cluster)[0]
    key = f"splitserve:workers:{model}:{alive.name}"
    rec = r.hgetall(key)
    assert rec["address"] == alive.grpc_address and rec["role"] == "colocated"
    assert rec["model"] == model and "block_major_v1" in rec["kv_layout"]
    assert 0 < r.pttl(key) <= 5000
    assert r.exists(f"splitserve:workers:{model}:colocated-1")
    r.close()


def test_fuzzed_http_front_keeps_every_invariant(cluster, model, offline) -> None:
    """A seeded fuzz of the HTTP front (bench/hostile.py: wrong types for every known
    field, extreme numbers, deep nesting, invalid UTF-8, truncated and oversized bodies,
    hostile headers, unknown methods and paths, bodies and streams cut off): no 5xx,
    every error in vLLM's JSON, every process alive, the same greedy output after, and
    every block free once idle. What it found is pinned in
    tests/unit/gateway/test_hostile_http.py."""
    from bench.hostile import Endpoint, HostileRequests, check_answer, send
    from gateway.params import IMPLEMENTED, REFUSED

    port = cluster.http_port
    probe = {"model": model, "prompt": "The fuzz probe", "max_tokens": 8, "temperature": 0}
    ref = offline.generate("The fuzz probe", SamplingParams(max_tokens=8, temperature=0))[0]
    assert call_http(port, "POST", "/v1/completions", probe)[1]["choices"][0]["text"] \
        == ref.text
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    profile = call_http(port, "GET", "/admin/v1/routing", headers=admin)[1]
    strategies = call_http(port, "GET", "/api/v1/scheduling/strategies", headers=admin)[1]
    fields = {e: tuple(sorted(IMPLEMENTED[e] | set(REFUSED[e]))) for e in IMPLEMENTED}
    endpoints = [
        Endpoint("/v1/completions", {"model": model, "prompt": "fuzz", "max_tokens": 4,
                                     "temperature": 0}, fields["completions"], stream=True),
        Endpoint("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 4}, fields["chat"], stream=True),
        Endpoint("/tokenize", {"prompt": "hello"}, ("model", "prompt", "messages",
                                                    "add_special_tokens", "return_token_strs")),
        Endpoint("/detokenize", {"tokens": [1, 2, 3]}, ("model", "tokens")),
        Endpoint("/admin/v1/routing", profile, tuple(profile), admin=True),
        Endpoint("/api/v1/scheduling/strategies", {"scheduling": [
            {"weight": 2, "selectors": [{"key": "tenant", "value": "x"}]}]},
            ("scheduling",), admin=True)]
    problems, statuses = [], set()
    try:
        for req in itertools.islice(HostileRequests(15, endpoints, 4 * 1024 * 1024,
                                                    admin_key=ADMIN_KEY), 400):
            ans = send(port, req)
            statuses.add(ans.status)
            if (problem := check_answer(req, ans)) is not None:
                problems.append(f"{req.describe()}\n  -> {problem}")
    finally:  # what valid admin bodies changed goes back
        call_http(port, "POST", "/admin/v1/routing", profile, headers=admin)
        call_http(port, "POST", "/api/v1/scheduling/strategies",
                  {"scheduling": strategies["scheduling"]}, headers=admin)
    assert not problems, "\n".join(problems[:10])
    assert {200, 400, 401, 404, 405} <= statuses  # it reached past validation, too
    cluster.check_alive()
    assert call_http(port, "POST", "/v1/completions", probe)[1]["choices"][0]["text"] \
        == ref.text

    def all_free() -> bool:
        reps = [load_report(w.grpc_address) for w in workers(cluster)]
        return all(r.num_free_blocks == r.num_blocks and r.num_active == 0 for r in reps)
    wait_for(all_free, 15, "every block free after the fuzz")


def test_killed_worker_leaves_routing_and_requests_succeed(cluster, model) -> None:
    victim = workers(cluster)[1]
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)

    def gone() -> bool:
        _, snap, _ = call_http(cluster.http_port, "GET", "/debug/workers")
        return not any(w["worker_id"] == victim.name and w["routable"] for w in snap)
    wait_for(gone, 3, "the killed worker to leave routing")  # DESIGN: within ~2 s
    for i in range(6):
        got, payload, _ = call_http(cluster.http_port, "POST", "/v1/completions",
                                    {"prompt": f"request {i}", "max_tokens": 3})
        assert got == 200, payload
    # Its registration expires by itself (heartbeat TTL), so discovery forgets it.
    import redis

    r = redis.Redis.from_url(cluster.redis_url, socket_timeout=2)
    wait_for(lambda: not r.exists(f"splitserve:workers:{model}:{victim.name}"), 8,
             "the killed worker's registration to expire")
    r.close()


def test_gateway_keeps_known_workers_when_redis_goes_away(cluster, model) -> None:
    redis_child = next(c for c in cluster.children if c.name == "redis")
    cluster.stop_child(redis_child)
    time.sleep(2.5)  # a few discovery rounds against a dead Redis
    for i in range(3):
        got, payload, _ = call_http(cluster.http_port, "POST", "/v1/completions",
                                    {"prompt": f"no redis {i}", "max_tokens": 3})
        assert got == 200, payload


def test_drained_worker_finishes_in_flight_work_exits_0_and_gateway_answers_503(
        cluster, model) -> None:
    import threading

    alive = workers(cluster)[0]
    result: dict = {}

    def long_request() -> None:
        result["r"] = call_http(cluster.http_port, "POST", "/v1/completions",
                                {"prompt": "drain me", "max_tokens": 300,
                                 "ignore_eos": True, "temperature": 0})
    t = threading.Thread(target=long_request)
    t.start()
    wait_for(lambda: load_report(alive.grpc_address).num_active == 1, 10,
             "the long request to start")
    assert cluster.stop_child(alive) == 0  # SIGTERM: drain, deregister, exit 0
    t.join(30)
    status, payload, _ = result["r"]
    assert status == 200 and payload["usage"]["completion_tokens"] == 300, payload
    wait_for(lambda: call_http(cluster.http_port, "GET", "/health")[0] == 503, 5,
             "gateway health to report no worker")
    got, payload, _ = call_http(cluster.http_port, "POST", "/v1/completions",
                                {"prompt": "anyone?", "max_tokens": 2})
    assert got == 503 and payload["error"]["code"] == 503
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as ch:
        with pytest.raises(grpc.RpcError) as ei:
            list(pb_grpc.GenerateStub(ch).Generate(pb.GenerateRequest(prompt="x"), timeout=10))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
