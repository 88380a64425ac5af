"""The client side of `splitserve bench chaos`: a seeded mix of requests sent to several
gateways as a load balancer would, each answer judged against a fault-free reference.

Requests come from a fixed pool of templates (greedy and seeded sampling, streamed and
not, n > 1, structured outputs, long prompts sharing a prefix and short ones), so the
same template can be checked token for token (`logprobs: 0` returns every token, also
those with no text) against its first, fault-free answer.

A request goes to the next gateway in turn; one refused at connect goes to the other
(what a load balancer does with a backend that is down). Past that, nothing is retried:
a request that breaks is a clean error when the client can tell (an HTTP error, an SSE
`error` event, a connection that drops before `[DONE]`), wrong when it looks complete
but differs from the reference (a stream cut short included), hung when it outlives its
deadline.
"""

from __future__ import annotations

import http.client
import json
import random
import time
from dataclasses import dataclass
from typing import Any

MAX_TOKENS = 16
CHOICES = ["alpha", "beta", "gamma"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
KINDS = ("greedy", "greedy_stream", "seeded", "seeded_stream", "n", "choice", "schema")


@dataclass(frozen=True, slots=True)
class Template:
    key: int
    kind: str
    body: dict[str, Any]

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass(slots=True)
class Outcome:
    key: int
    kind: str
    gateway: int  # index of the gateway that answered (or was tried last)
    start: float  # time.monotonic()
    end: float
    result: str  # "ok" | "error" | "wrong" | "hung"
    detail: str = ""


def templates(model: str, seed: int, count: int = 28) -> list[Template]:
    """`count` requests, seeded: kinds in turn, prompts long (a shared 150-word prefix
    and a distinct tail: disaggregated clusters prefill them remotely) or short."""
    rng = random.Random(seed)
    words = ["fox", "river", "stone", "cloud", "ember", "maple", "orbit", "quartz", "tide",
             "lantern", "harbor", "meadow"]
    prefix = " ".join(rng.choice(words) for _ in range(150))  # ~600 tokens
    out = []
    for key in range(count):
        kind = KINDS[key % len(KINDS)]
        tail = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        prompt = f"{prefix} {tail}" if rng.random() < 0.5 else tail
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                "temperature": 0, "ignore_eos": True, "logprobs": 0}
        if kind.startswith("seeded") or kind == "n":
            body.update(temperature=0.8, top_k=40, seed=key)
        if kind == "n":
            body["n"] = 2
        if kind.endswith("_stream"):
            body["stream"] = True
        if kind == "choice":
            body = {**body, "structured_outputs": {"choice": CHOICES}, "ignore_eos": False}
        if kind == "schema":
            body = {**body, "max_tokens": 40, "ignore_eos": False, "response_format": {
                "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
        out.append(Template(key, kind, body))
    return out


class _Cut(Exception):
    """The connection dropped or the answer broke off: a clean error at the client."""


def _choices_of(events: list[dict[str, Any]]) -> list[tuple[str, list[str], str | None]]:
    """A stream's events -> (text, tokens, finish_reason) per choice index."""
    acc: dict[int, tuple[str, list[str], str | None]] = {}
    for ev in events:
        for c in ev.get("choices", []):
            text, toks, fin = acc.get(c["index"], ("", [], None))
            lp = c.get("logprobs") or {}
            acc[c["index"]] = (text + (c.get("text") or ""), toks + list(lp.get("tokens") or []),
                               c.get("finish_reason") or fin)
    return [acc[i] for i in sorted(acc)]


def _read_stream(resp: http.client.HTTPResponse, deadline: float
                 ) -> list[tuple[str, list[str], str | None]]:
    events: list[dict[str, Any]] = []
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("stream past its deadline")
        line = resp.readline()
        if not line:
            raise _Cut("the stream ended before [DONE]")
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            return _choices_of(events)
        ev = json.loads(data)
        if "error" in ev:
            raise _Cut(f"error event: {str(ev['error'])[:120]}")
        events.append(ev)


def _answer(port: int, tpl: Template, deadline: float
            ) -> list[tuple[str, list[str], str | None]]:
    """The request's choices; raises ConnectionRefusedError (try another gateway),
    _Cut (a clean error), TimeoutError / socket.timeout (hung)."""
    conn = http.client.HTTPConnection("127.0.0.1", port,
                                      timeout=max(0.1, deadline - time.monotonic()))
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(tpl.body).encode(),
                     headers={"Content-Type": "application/json"})
        try:
            resp = conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
            raise _Cut(f"connection dropped: {type(e).__name__}") from e
        if resp.status != 200:
            body = resp.read()[:200]
            raise _Cut(f"HTTP {resp.status}: {body.decode(errors='replace')}")
        try:
            if tpl.stream:
                return _read_stream(resp, deadline)
            doc = json.loads(resp.read())
        except (http.client.IncompleteRead, ConnectionResetError, ValueError) as e:
            raise _Cut(f"answer broke off: {type(e).__name__}") from e
        return [(c.get("text") or "", list((c.get("logprobs") or {}).get("tokens") or []),
                 c.get("finish_reason")) for c in doc.get("choices", [])]
    finally:
        conn.close()


def _problem(tpl: Template, got: list[tuple[str, list[str], str | None]]) -> str | None:
    """What makes a complete-looking answer wrong regardless of the reference."""
    n = int(tpl.body.get("n", 1))
    if len(got) != n:
        return f"{len(got)} choices, asked {n}"
    for text, _, fin in got:
        if fin is None:
            return "a choice without a finish reason (cut short)"
        if tpl.kind == "choice" and text not in CHOICES:
            return f"{text!r} is not one of {CHOICES}"
    return None


class ChaosClient:
    """Sends templates to the gateways (`ports`), judges answers against `refs` (the
    first fault-free answer per template key; set by `reference`)."""

    def __init__(self, ports: list[int], tpls: list[Template], timeout_s: float) -> None:
        self.ports, self.tpls, self.timeout_s = ports, tpls, timeout_s
        self.refs: dict[int, list[tuple[str, list[str], str | None]]] = {}
        self._turn = 0

    def reference(self) -> None:
        """Each template once, in order, fault-free: the references. Raises RuntimeError
        when one fails (the cluster is not serving: nothing to measure against)."""
        for tpl in self.tpls:
            out = self.send(tpl)
            if out.result != "ok":
                raise RuntimeError(f"reference request {tpl.key} ({tpl.kind}): "
                                   f"{out.result} {out.detail}")

    def send(self, tpl: Template) -> Outcome:
        start = time.monotonic()
        deadline = start + self.timeout_s
        first = self._turn % len(self.ports)
        self._turn += 1
        gw = first
        try:
            for i in range(len(self.ports)):  # refused at connect: the next gateway
                gw = (first + i) % len(self.ports)
                try:
                    got = _answer(self.ports[gw], tpl, deadline)
                    break
                except ConnectionRefusedError:
                    if i == len(self.ports) - 1:
                        raise _Cut("every gateway refused the connection") from None
        except _Cut as e:
            return Outcome(tpl.key, tpl.kind, gw, start, time.monotonic(), "error", str(e))
        except TimeoutError as e:
            return Outcome(tpl.key, tpl.kind, gw, start, time.monotonic(), "hung", str(e))
        except OSError as e:  # reset while sending, and the like: the client knows
            return Outcome(tpl.key, tpl.kind, gw, start, time.monotonic(), "error",
                           f"{type(e).__name__}: {e}")
        end = time.monotonic()
        problem = _problem(tpl, got)
        if problem is None:
            ref = self.refs.setdefault(tpl.key, got)
            if ref != got:
                problem = f"differs from the reference: {got!r} vs {ref!r}"[:400]
        return Outcome(tpl.key, tpl.kind, gw, start, end, "wrong" if problem else "ok",
                       problem or "")
