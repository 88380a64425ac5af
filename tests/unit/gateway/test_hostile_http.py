"""What the HTTP fuzz (tests/integration/serving/test_fuzz.py) found, pinned: each request
once got a 500 (an exception escaping the handler, here or at the worker call), or its
bad x-request-id was passed on to gRPC metadata and logs; now it gets a 400/401 in
vLLM's error JSON before any routing. Raw bytes on a socket (bench/hostile.py), against the
HTTP front without workers (aiohttp's test server on loopback)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from bench.hostile import HostileRequest, check_answer, nested, send
from gateway.body import parse_json
from gateway.errors import InvalidRequest
from gateway.http_server import build_app
from tests.factories import workerless_gateway

ADMIN = "hostile-admin-key"
JSON = ("Content-Type", b"application/json")


def _post(path: str, body: bytes | str, *headers: tuple[str, bytes]) -> HostileRequest:
    raw = body.encode() if isinstance(body, str) else body
    return HostileRequest("regression", "POST", path, [JSON, *headers], raw)


def _completion(field: str, value: str) -> HostileRequest:
    return _post("/v1/completions", f'{{"prompt": "hi", "max_tokens": 2, "{field}": {value}}}')


CASES: list[tuple[str, HostileRequest, int]] = [
    # json.loads raised RecursionError (not a ValueError); yaml.safe_load the same.
    ("deep body", _post("/v1/completions", nested(200_000)), 400),
    ("deep field", _post("/detokenize", '{"tokens": ' + nested(5_000) + "}"), 400),
    ("deep strategies", _post("/api/v1/scheduling/strategies", nested(200_000),
                              ("Authorization", f"Bearer {ADMIN}".encode())), 400),
    ("deep routing", _post("/admin/v1/routing", "[" * 100_000,
                           ("Authorization", f"Bearer {ADMIN}".encode())), 400),
    # float(10**400) raised OverflowError.
    ("10**400 top_p", _completion("top_p", "1" + "0" * 400), 400),
    ("10**400 penalty", _completion("repetition_penalty", "1" + "0" * 400), 400),
    # Python's json takes NaN / Infinity / 1e999 (not JSON).
    ("NaN", _completion("top_p", "NaN"), 400),
    ("1e999", _completion("temperature", "1e999"), 400),
    # A lone surrogate (a JSON \ud800 escape) cannot be encoded: protobuf, the tokenizer
    # and the block hash's cache salt raised UnicodeEncodeError.
    ("surrogate stop", _completion("stop", '"\\ud800"'), 400),
    ("surrogate salt", _completion("cache_salt", '"\\udfff x"'), 400),
    ("surrogate regex", _completion("guided_regex", '"\\ud83e"'), 400),
    ("surrogate tokenize", _post("/tokenize", '{"prompt": "\\ud800"}'), 400),
    # Header bytes that are not UTF-8 reach the app as lone surrogates.
    ("admin key bytes", HostileRequest("regression", "GET", "/admin/v1/routing",
                                       [("Authorization", b"Bearer \xff\xfe")], b""), 401),
    ("labels bytes", _post("/v1/completions", '{"prompt": "hi", "max_tokens": 2}',
                           ("X-Labels", b"a=\xff")), 400),
    ("request id bytes", _post("/tokenize", '{"prompt": "hi"}', ("x-request-id", b"\xc3\xa9")),
     400),
    ("request id spaces", _post("/tokenize", '{"prompt": "hi"}',
                                ("x-request-id", b"id with spaces")), 400),
    ("request id ok", _post("/tokenize", '{"prompt": "hi"}', ("x-request-id", b"trace-1:a/b")),
     200),
]


async def _answers(requests: list[HostileRequest]) -> list[Any]:
    gw = workerless_gateway(admin_key=ADMIN)
    async with TestServer(build_app(gw)) as server:
        return [await asyncio.to_thread(send, server.port, r) for r in requests]


def test_what_the_fuzz_found_gets_a_clean_4xx() -> None:
    answers = asyncio.run(_answers([r for _, r, _ in CASES]))
    for (name, req, status), ans in zip(CASES, answers):
        assert ans.status == status, (name, ans.status, ans.body[:300])
        assert check_answer(req, ans) is None, name
    rids = [a.headers["x-request-id"] for a in answers[-3:]]
    assert rids[0] != "\xc3\xa9" and rids[1] != "id with spaces" and rids[2] == "trace-1:a/b"
    assert json.loads(answers[-3].body)["error"]["param"] == "x-request-id"


@pytest.mark.parametrize("raw", [b'{"a": NaN}', b'{"a": -Infinity}', b"[1e400]",
                                 b'{"a": 18446744073709551616}', b'{"\\ud800": 1}',
                                 b"[" * 65 + b"]" * 65])
def test_parse_json_is_strict(raw: bytes) -> None:
    with pytest.raises(InvalidRequest):
        parse_json(raw)


def test_parse_json_takes_ordinary_bodies() -> None:
    doc = {"a": [1, -2**63, 2**64 - 1, 1e308, "\u00e9\U0001f98a", None], "b": {"c": True}}
    assert parse_json(json.dumps(doc).encode()) == doc
    assert parse_json(b"[" * 64 + b"]" * 64) is not None


def test_parse_json_bounds_integers_anywhere() -> None:
    for raw in (b"18446744073709551616", b'{"p": [1, 2, -18446744073709551616]}',
                b'{"p": [1, "a", [18446744073709551616]]}'):
        with pytest.raises(InvalidRequest, match="out of range"):
            parse_json(raw)


def test_a_long_token_id_body_parses() -> None:
    raw = json.dumps({"prompt": list(range(10**6, 10**6 + 500_000)), "n": [[1, 2**63]]})
    body = parse_json(raw.encode())
    assert body["prompt"][-1] == 10**6 + 499_999 and body["n"] == [[1, 2**63]]


def test_a_long_body_parsed_in_pieces_reads_as_one_call(monkeypatch) -> None:
    """Pieces of a few bytes split every long integer array at every comma: each body,
    valid or broken (a missing item at a split, a trailing comma, a repeated key whose
    skipped value one call refuses, an array that is not all integers), parses to the
    same value, or fails, as one msgspec call does."""
    import random

    import msgspec

    from gateway import body as gw_body

    monkeypatch.setattr(gw_body, "PIECEWISE_BYTES", 0)
    monkeypatch.setattr(gw_body, "_PIECE_BYTES", 4)
    rng = random.Random(7)
    ids = ",".join(str(rng.randrange(-5, 10**6)) for _ in range(40))
    bodies = [f'{{"prompt": [{ids}], "max_tokens": 4}}', f'{{"p": [ {ids} ] , "q": [[{ids}]]}}',
              f'{{"p": [{ids},]}}', f'{{"p": [{ids},,1]}}', f'{{"p": [,{ids}]}}',
              f'{{"p": [{ids}], "p": [1e400]}}', f'{{"p": [1e400], "p": [{ids}]}}',
              f'{{"p": [{ids}, 2.5]}}', f'{{"p": [{ids}, 99999999999999999999999]}}',
              f'[{ids}]', f'{{"p": [{ids}]', f'{{"\\u0070": 1, "p": [{ids}]}}',
              f'{{"p": [{ids}1-2]}}', f'{{"p": [{ids}]}}x', f'{{"p": [{ids}, "7,8", 9]}}',
              f'{{"p": [{ids}, "7,8", 9, 1e400]}}']
    bodies += [f'{{"p": [{ids[:i]},{ids[i:]}]}}'  # a missing item at every comma
               for i, c in enumerate(ids) if c == ","]
    for text in bodies:
        raw = text.encode()
        try:
            want: Any = msgspec.json.decode(raw)
            gw_body._check_json(want)
        except (msgspec.DecodeError, ValueError):
            want = InvalidRequest
        try:
            got: Any = parse_json(raw)
        except InvalidRequest:
            got = InvalidRequest
        assert got == want, text
    assert sum(b.count(",,") for b in bodies) == 40
