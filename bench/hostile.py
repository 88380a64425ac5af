"""Hostile HTTP traffic for the gateway's OpenAI front, and the answer every request must
get. Used by the HTTP fuzz test and `splitserve bench soak`.

- `HostileRequests(seed, ...)`: a seeded generator of requests — known fields set to
  wrong types and extreme numbers (NaN, Infinity, 10**400, 2**64, ...), deeply nested
  JSON, invalid UTF-8, lone surrogates, truncated JSON, huge strings within the size
  limit, oversized bodies, random Authorization / X-Tenant / X-Labels / x-request-id
  headers, unknown methods and paths, a request body cut off, a stream cut off — plus
  unchanged valid requests. The same seed gives the same requests.
- `send(port, req)`: sends one over a raw socket (any bytes, hang up at any point).
- `check_answer(req, answer)`: the invariants — never a 5xx (a 503 only when allowed:
  no worker), every error vLLM's JSON shape with the response's status, an SSE stream
  that ends with `[DONE]`.
"""

from __future__ import annotations

import json
import random
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Fields the generator mistypes, per endpoint (the fuzz test passes the gateway's own
# lists, gateway/params.py; these are OpenAI's and vLLM's common ones).
COMPLETION_FIELDS = (
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "best_of", "seed",
    "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "logprobs", "echo",
    "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "stream", "stream_options", "cache_salt", "priority", "metadata",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "user", "add_special_tokens", "suffix", "min_p")
CHAT_FIELDS = (
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
    "seed", "stop", "logprobs", "top_logprobs", "stream", "stream_options", "tools",
    "tool_choice", "parallel_tool_calls", "response_format", "add_generation_prompt",
    "metadata", "priority", "cache_salt", "logit_bias")
TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_special_tokens",
                   "add_generation_prompt", "return_token_strs")
DETOKENIZE_FIELDS = ("model", "tokens")
STRATEGY_FIELDS = ("scheduling", "version")

KNOWN_METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE")
METHODS = (*KNOWN_METHODS, "BREW")
PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
         "/v1/models", "/health", "/metrics", "/admin/v1/routing",
         "/api/v1/scheduling/strategies", "/debug/workers")


@dataclass(slots=True)
class HostileRequest:
    """One request as bytes on the wire. `cut`: None (read the whole answer),
    "body" (send part of the body, then hang up), "stream" (read `events` SSE events,
    then hang up). `kind` names the mutation (for reports)."""

    kind: str
    method: str
    path: str
    headers: list[tuple[str, bytes]]
    body: bytes
    cut: str | None = None
    events: int = 0

    @property
    def framing_error(self) -> bool:
        """Not HTTP the server's parser takes (a method it does not know, a control byte
        in a header): it answers 400 itself, before any route, as uvicorn does for vLLM,
        so that answer is not in vLLM's error JSON."""
        return self.method not in KNOWN_METHODS or any(
            b < 0x20 and b != 0x09 or b == 0x7F for _, v in self.headers for b in v)

    def describe(self) -> str:
        body = self.body if len(self.body) <= 200 else self.body[:200] + b"..."
        return f"{self.kind}: {self.method} {self.path} {self.headers!r} {body!r}"


@dataclass(slots=True)
class Answer:
    status: int  # 0: no answer (we hung up, or the server closed without one)
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class Endpoint:
    path: str
    base: Mapping[str, Any]  # a valid body
    fields: tuple[str, ...]
    stream: bool = False  # takes "stream": true
    admin: bool = False  # needs the admin key


def nested(depth: int, leaf: Any = 1) -> str:
    """JSON text nested `depth` levels deep (arrays and objects alternating)."""
    return '{"a":[' * (depth // 2) + json.dumps(leaf) + "]}" * (depth // 2)


def _schema(depth: int) -> dict[str, Any]:
    """response_format with a JSON schema of objects nested `depth` deep."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}


class HostileRequests:
    """A seeded stream of hostile requests against `endpoints`.

    `max_body`: the gateway's body limit (oversized bodies go just past it, huge
    strings stay within it). `admin_key`: sent on admin routes half of the time (the
    other half a wrong or missing one). `huge_every`: one request in this many carries
    a string of up to `max_body` / 4 bytes (huge bodies cost the server tokenization
    time; soaks keep them rare)."""

    def __init__(self, seed: int, endpoints: Sequence[Endpoint], max_body: int,
                 admin_key: str | None = None, huge_every: int = 40) -> None:
        self.rng = random.Random(seed)
        self.endpoints = list(endpoints)
        self.max_body = max_body
        self.admin_key = admin_key
        self.huge_every = huge_every
        self.count = 0

    # -- values ------------------------------------------------------------------------
    def value(self) -> Any:
        """A hostile JSON value, as text (so NaN, 10**400 and lone surrogates survive)."""
        r = self.rng
        pool: list[Any] = [
            "null", "true", "false", "0", "-1", "1", "2147483648", "-2147483649",
            "9223372036854775808", "18446744073709551616", "-9223372036854775809",
            "1" + "0" * 400, "1e308", "-1e308", "1e999", "-1e999", "5e-324", "-0.0", "0.5",
            "NaN", "Infinity", "-Infinity", '""', '"x"', '"\\ud800"', '"\\udfff x"',
            '"\\u0000"', json.dumps("🦊" * r.randint(1, 50)), json.dumps("a" * 10_000),
            "[]", "[null]", '[1, "a", {}]', "[-1, 2147483648]", "[1e999]", "{}",
            '{"": ""}', '{"a": {"b": []}}', '{"type": "json_schema"}', '{"1": NaN}',
            '{"99999999999999999999": 1}', '{"-5": 1}', '[{"role": 1}]',
            '[{"role": "user", "content": [{"type": "image_url"}]}]',
            nested(r.choice((50, 400, 5_000))),
            # Right types, edge values: the work a valid request may ask for.
            "128", "20", "767", '"(a|aa)*$"', '"["', '["\\n", "", "a"]',
            '{"type": "json_object"}', json.dumps(_schema(r.choice((2, 30, 70)))),
            json.dumps(list(range(r.choice((1, 700, 3000))))),
        ]
        return r.choice(pool)

    def _body(self, ep: Endpoint) -> bytes:
        """The endpoint's valid body with 1-3 fields replaced by hostile values."""
        r = self.rng
        parts = {k: json.dumps(v) for k, v in ep.base.items()}
        for name in r.sample(ep.fields, k=min(len(ep.fields), r.randint(1, 3))):
            parts[name] = self.value()
        return ("{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in parts.items())
                + "}").encode()

    def _junk(self, ep: Endpoint) -> bytes:
        r = self.rng
        valid = json.dumps(dict(ep.base)).encode()
        return r.choice([
            b"", b"null", b"[1, 2]", b'"a string"', b"42", b"{", b"}", b"\x00" * 16,
            valid[:r.randint(1, len(valid) - 1)],  # truncated JSON
            valid.replace(b'"', b"'"), valid + b" trailing", valid + b"," + valid,
            b'{"prompt": "\xff\xfe\xc3\x28", "max_tokens": 2}',  # invalid UTF-8
            b'\xef\xbb\xbf' + valid,  # a UTF-8 byte-order mark
            valid.decode().encode("utf-16"), nested(200_000).encode(),
            b'{"prompt": "a", "max_tokens": 2, "max_tokens": "x"}',  # a repeated key
            bytes(r.randrange(256) for _ in range(r.randint(1, 300))),
        ])

    def _huge(self, ep: Endpoint) -> bytes:
        r = self.rng
        if r.random() < 0.3:  # just past the limit
            return b'{"prompt": "' + b"a" * (self.max_body + 16) + b'"}'
        size = r.randint(self.max_body // 64, self.max_body // 4)
        body = dict(ep.base)
        key = r.choice([k for k, v in ep.base.items() if isinstance(v, str)] or ["user"])
        body[key] = "".join(r.choice("ab cd\u00e9\u4e2d") for _ in range(64)) * (size // 64)
        return json.dumps(body).encode()

    def _headers(self, ep: Endpoint, hostile: bool) -> list[tuple[str, bytes]]:
        r = self.rng
        h = [("Content-Type", b"application/json")]
        if ep.admin and (not hostile or r.random() < 0.5) and self.admin_key:
            h.append(("Authorization", b"Bearer " + self.admin_key.encode()))
        if not hostile:
            return h
        junk = [b"", b" ", b"Bearer", b"Bearer ", b"Basic Zm9vOmJhcg==", b"Bearer \xff\xfe",
                b"Bearer " + b"k" * 4000, b"x" * 6000, b"\xc3\xa9t\xc3\xa9", b"a=b,c",
                b"=,=,", b"tenant=" + b"t" * 600, b"../../etc", b"-1", b"\x7f\x01",
                b"id with spaces", b"\t", b"r" * 300, b"\xe2\x80\xae", b"abc-123_x.y:z/1"]
        for name in r.sample(["Authorization", "X-Tenant", "X-Labels", "x-request-id",
                              "Content-Type", "Accept", "X-Forwarded-For"], k=r.randint(1, 3)):
            h = [(k, v) for k, v in h if k != name] + [(name, r.choice(junk))]
        return h

    # -- requests ----------------------------------------------------------------------
    def __iter__(self) -> HostileRequests:
        return self

    def __next__(self) -> HostileRequest:
        self.count += 1
        r = self.rng
        ep = r.choice(self.endpoints)
        kind = r.choices(["fields", "junk", "headers", "valid", "method", "cut_body",
                          "cut_stream"], weights=[40, 15, 12, 10, 8, 5, 5])[0]
        if self.count % self.huge_every == 0:
            kind = "huge"
        if kind == "cut_stream" and not ep.stream:
            kind = "valid"
        hostile = kind == "headers"
        method, path = "POST", ep.path
        if kind == "method":
            method = r.choice(METHODS)
            path = r.choice([*PATHS, "/", "//v1//completions", "/v1/completions/../models",
                             "/%ff%fe", "/v1/" + "x" * 3000, "/v2/completions",
                             "/v1/completions?stream=true"])
        body = (self._body(ep) if kind == "fields" else self._junk(ep) if kind == "junk"
                else self._huge(ep) if kind == "huge"
                else json.dumps({**ep.base, "stream": True}
                                if kind == "cut_stream" or (ep.stream and r.random() < 0.3)
                                else dict(ep.base)).encode())
        return HostileRequest(kind, method, path, self._headers(ep, hostile), body,
                              cut="body" if kind == "cut_body" else
                              "stream" if kind == "cut_stream" else None,
                              events=r.randint(1, 3))


# -- the wire ----------------------------------------------------------------------------
def send(port: int, req: HostileRequest, host: str = "127.0.0.1",
         timeout: float = 60.0) -> Answer:
    """Sends `req` over a fresh connection (`Connection: close`) and reads the answer;
    hangs up early as `req.cut` says (then the answer is what was read so far)."""
    head = [f"{req.method} {req.path} HTTP/1.1".encode(), f"Host: {host}".encode(),
            b"Connection: close", f"Content-Length: {len(req.body)}".encode()]
    head += [k.encode() + b": " + v for k, v in req.headers]
    data = b"\r\n".join(head) + b"\r\n\r\n"
    with socket.create_connection((host, port), timeout=timeout) as s:
        if req.cut == "body":
            s.sendall(data + req.body[:len(req.body) // 2])
            return Answer(0)
        s.sendall(data + req.body)
        raw = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            raw += chunk
            if req.cut == "stream" and raw.count(b"data: ") >= req.events:
                break
    return parse_answer(raw, whole=req.cut is None)


def parse_answer(raw: bytes, whole: bool = True) -> Answer:
    """An HTTP/1.1 response read until the server closed it (`whole`) or cut."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        return Answer(0, body=raw)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if whole and headers.get("transfer-encoding", "").lower() == "chunked":
        body = _dechunk(body)
    return Answer(status, headers, body)


def _dechunk(data: bytes) -> bytes:
    out, i = b"", 0
    while True:
        end = data.find(b"\r\n", i)
        if end < 0:
            raise ValueError("truncated chunked body")
        size = int(data[i:end].split(b";")[0], 16)
        if size == 0:
            return out
        out += data[end + 2:end + 2 + size]
        i = end + 2 + size + 2


# -- the invariants ----------------------------------------------------------------------
def check_answer(req: HostileRequest, ans: Answer, allow_503: bool = False) -> str | None:
    """None when `ans` is a correct answer to `req`, else what is wrong."""
    if req.cut == "body":
        return None  # nothing to read: the server only has to survive it
    if ans.status == 0:
        return "no HTTP answer"
    if ans.status >= 500 and not (allow_503 and ans.status == 503):
        return f"status {ans.status}: {ans.body[:300]!r}"
    ctype = ans.headers.get("content-type", "")
    if ans.status >= 400:
        if req.method == "HEAD" or (req.framing_error and ans.status == 400):
            return None  # no body by definition; the HTTP parser's own answer
        return _error_shape(ans.body, ans.status)
    if req.cut is None and ctype.startswith("text/event-stream"):
        return _sse_shape(ans.body)
    return None


def _error_shape(raw: bytes, status: int) -> str | None:
    try:
        err = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return f"status {status} without vLLM's error JSON: {raw[:300]!r}"
    if not (isinstance(err, dict) and err.get("code") == status and err.get("message")
            and isinstance(err.get("type"), str) and "param" in err):
        return f"status {status} with a malformed error: {err!r}"
    return None


def _sse_shape(body: bytes) -> str | None:
    events = [e for e in body.split(b"\n\n") if e.strip()]
    if not events or events[-1].strip() != b"data: [DONE]":
        return f"an SSE stream that does not end with [DONE]: {body[-300:]!r}"
    for e in events[:-1]:
        if not e.startswith(b"data: "):
            return f"a malformed SSE event: {e[:200]!r}"
        doc = json.loads(e[6:])
        if "error" in doc:
            code = doc["error"].get("code") if isinstance(doc["error"], dict) else None
            if not isinstance(code, int) or code >= 500:
                return f"an SSE error event: {doc!r}"
    return None
