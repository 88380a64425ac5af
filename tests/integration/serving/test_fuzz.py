"""Bad and hostile input against the shared cluster (conftest.py): each bad request
gets its status in vLLM's error JSON, and a seeded fuzz of the HTTP front leaves every
invariant standing."""

from __future__ import annotations

import itertools

from engine.sampling_params import SamplingParams
from tests.integration.serving.shared import ADMIN_KEY, MAX_MODEL_LEN, workers
from tests.integration.serving_util import call_http, load_report, wait_for


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
