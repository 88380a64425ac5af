"""`splitserve bench soak`: a mixed load against a local cluster started as `splitserve
up` starts it (the same flags; free ports unless given), for `--duration` seconds,
supervised as `splitserve up` supervises it, then the invariants:

- every answer right: a valid request gets 200 and the same output as the first answer
  to the same request (greedy, or seeded sampling for n > 1), streamed or not; a bad
  one gets its 4xx in vLLM's error JSON; never a 5xx (bench/hostile.py checks);
- every process alive and never restarted;
- every worker's KV blocks free once idle (no leak);
- each process's resident memory grew at most `--max-rss-growth-mb`, and its open file
  descriptors at most by `--concurrency`, between a sample after the warm-up (every
  kind once, then `--warmup` seconds of the same load: caches and compiled grammars
  exist by then) and one at the end. Connection pools (the gateway's Redis client, and
  so Redis's own fds) keep as many connections as were ever used at once, at most one
  per request in flight; a leak grows with the number of requests instead.

Kinds of request (seeded mix, `--concurrency` client loops): `valid` (completion),
`chat`, `stream`, `cancelled` (a stream the client hangs up on), `malformed`
(bench/hostile.py), `n` (n=3 seeded samples), `structured` (a choice or a JSON schema),
`over_limit` (past the context, n or max_tokens limits: 400).

Prints one table per kind (sent, right, statuses, p50/p99 latency) and one per process
(RSS and fds at start and end, restarts); exits 1 when an invariant fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from bench.hostile import (
    COMPLETION_FIELDS,
    Endpoint,
    HostileRequest,
    HostileRequests,
    check_answer,
    send,
)
from bench.invariants import ProcSample, idle_blocks, sample_all
from cluster.launcher import LocalCluster

WEIGHTS = {"valid": 16, "chat": 8, "stream": 16, "cancelled": 10, "malformed": 22, "n": 8,
           "structured": 10, "over_limit": 10}
MAX_TOKENS = 12
CHOICES = ["alpha", "beta", "gamma"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cluster.up import add_arguments as up_arguments

    up_arguments(p)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the "
                   "start sample (not checked against RSS / fds)")
    p.add_argument("--concurrency", type=int, default=4, help="client loops")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth-mb", type=float, default=64.0,
                   help="allowed growth of each process's resident memory")
    p.add_argument("--json", default=None, help="also write the result here")


@dataclass(slots=True)
class Outcome:
    kind: str
    status: int
    seconds: float
    problem: str | None = None


@dataclass(slots=True)
class SoakResult:
    duration_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    start: dict[str, ProcSample | None] = field(default_factory=dict)
    end: dict[str, ProcSample | None] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    leaked: dict[str, int] = field(default_factory=dict)  # blocks not free (or -1)
    max_rss_growth_mb: float = 64.0
    concurrency: int = 4  # the fds a process may gain (connection pools)

    def failures(self) -> list[str]:
        """Every broken invariant, in words (empty: all hold)."""
        out = [f"{o.kind}: {o.problem}" for o in self.outcomes if o.problem][:10]
        out += [f"{name} restarted {n} time(s)" for name, n in self.restarts.items() if n]
        out += [f"{name} is not running" for name, s in self.end.items() if s is None]
        out += [f"{name}: {n} KV blocks not free when idle" for name, n in self.leaked.items()
                if n]
        for name, s in self.end.items():
            a = self.start.get(name)
            if s is None or a is None:
                continue
            if (s.rss_bytes - a.rss_bytes) / 2**20 > self.max_rss_growth_mb:
                out.append(f"{name}: RSS grew {(s.rss_bytes - a.rss_bytes) / 2**20:.0f} MiB")
            if s.fds > a.fds + self.concurrency:
                out.append(f"{name}: open fds {a.fds} -> {s.fds}")
        return out

    def table(self) -> str:
        lines = ["| kind | sent | right | statuses | p50 ms | p99 ms |",
                 "|---|---:|---:|---|---:|---:|"]
        for kind in WEIGHTS:
            mine = [o for o in self.outcomes if o.kind == kind]
            if not mine:
                continue
            secs = sorted(o.seconds for o in mine)
            statuses: dict[int, int] = {}
            for o in mine:
                statuses[o.status] = statuses.get(o.status, 0) + 1
            st = " ".join(f"{k or 'cut'}:{v}" for k, v in sorted(statuses.items()))
            lines.append(f"| {kind} | {len(mine)} | {sum(not o.problem for o in mine)} | "
                         f"{st} | {_q(secs, 0.5) * 1e3:.0f} | {_q(secs, 0.99) * 1e3:.0f} |")
        lines += ["", "| process | RSS start MiB | RSS end MiB | fds start | fds end | "
                  "restarts | blocks not free |", "|---|---:|---:|---:|---:|---:|---:|"]
        for name, a in self.start.items():
            e = self.end.get(name)
            lines.append(f"| {name} | {_mib(a)} | {_mib(e)} | {a.fds if a else '-'} | "
                         f"{e.fds if e else '-'} | {self.restarts.get(name, 0)} | "
                         f"{self.leaked.get(name, '-')} |")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"duration_s": self.duration_s, "requests": len(self.outcomes),
                "kinds": {k: sum(o.kind == k for o in self.outcomes) for k in WEIGHTS},
                "failures": self.failures(), "restarts": self.restarts,
                "leaked_blocks": self.leaked, "max_rss_growth_mb": self.max_rss_growth_mb,
                "start": {k: asdict(v) if v else None for k, v in self.start.items()},
                "end": {k: asdict(v) if v else None for k, v in self.end.items()},
                "outcomes": [asdict(o) for o in self.outcomes]}


def _q(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _mib(s: ProcSample | None) -> str:
    return f"{s.rss_bytes / 2**20:.0f}" if s else "-"


class Load:
    """The request kinds. A valid kind's first answer is its reference; every later one
    must equal it (greedy, and seeded samples, are deterministic)."""

    def __init__(self, port: int, model: str, seed: int, max_model_len: int) -> None:
        self.port = port
        self.model = model
        self.max_model_len = max_model_len
        rng = random.Random(seed)
        words = "the quick brown fox jumps over a lazy dog while five wizards box".split()
        self.prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 40)))
                        for _ in range(6)]
        # Longer than the default decider threshold: disaggregated clusters prefill these
        # remotely and move their KV.
        self.prompts += [" ".join(rng.choice(words) for _ in range(300)) for _ in range(2)]
        self.refs: dict[Any, Any] = {}
        self.hostile = HostileRequests(seed, [
            Endpoint("/v1/completions", {"model": model, "prompt": "soak", "max_tokens": 4},
                     COMPLETION_FIELDS, stream=True),
            Endpoint("/tokenize", {"prompt": "soak"}, ("prompt", "messages", "model"))],
            max_body=4 * 1024 * 1024, huge_every=200)
        self.kinds: dict[str, Callable[[random.Random], Awaitable[Outcome]]] = {
            "valid": self.valid, "chat": self.chat, "stream": self.stream,
            "cancelled": self.cancelled, "malformed": self.malformed, "n": self.n,
            "structured": self.structured, "over_limit": self.over_limit}

    async def _post(self, kind: str, path: str, body: dict[str, Any]) -> tuple[Outcome, Any]:
        req = HostileRequest(kind, "POST", path, [("Content-Type", b"application/json")],
                             json.dumps(body).encode())
        t0 = time.monotonic()
        ans = await asyncio.to_thread(send, self.port, req)
        out = Outcome(kind, ans.status, time.monotonic() - t0, check_answer(req, ans))
        doc: Any = None
        if out.problem is None and ans.status == 200:
            if ans.headers.get("content-type", "").startswith("text/event-stream"):
                doc = [json.loads(e[6:]) for e in ans.body.decode().split("\n\n")
                       if e.startswith("data: {")]
            else:
                doc = json.loads(ans.body)
        return out, doc

    def _same(self, out: Outcome, key: Any, got: Any) -> Outcome:
        """`got` must equal the reference for `key` (the first answer sets it)."""
        if out.problem is None:
            if out.status != 200:
                out.problem = f"status {out.status} for a valid request"
            elif self.refs.setdefault(key, got) != got:
                out.problem = f"output {got!r} differs from {self.refs[key]!r}"
        return out

    def _greedy(self, i: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": self.prompts[i], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}

    async def valid(self, rng: random.Random) -> Outcome:
        i = rng.randrange(len(self.prompts))
        out, doc = await self._post("valid", "/v1/completions", self._greedy(i))
        return self._same(out, i, doc and doc["choices"][0]["text"])

    async def stream(self, rng: random.Random) -> Outcome:
        i = rng.randrange(len(self.prompts))
        out, doc = await self._post("stream", "/v1/completions",
                                    {**self._greedy(i), "stream": True})
        text = doc and "".join(c["choices"][0]["text"] for c in doc if c.get("choices"))
        return self._same(out, i, text)

    async def chat(self, rng: random.Random) -> Outcome:
        i = rng.randrange(len(self.prompts))
        out, doc = await self._post("chat", "/v1/chat/completions", {
            "model": self.model, "messages": [{"role": "user", "content": self.prompts[i]}],
            "max_tokens": MAX_TOKENS, "temperature": 0})
        return self._same(out, ("chat", i), doc and doc["choices"][0]["message"]["content"])

    async def n(self, rng: random.Random) -> Outcome:
        i = rng.randrange(len(self.prompts))
        out, doc = await self._post("n", "/v1/completions", {
            **self._greedy(i), "n": 3, "temperature": 0.8, "seed": i})
        return self._same(out, ("n", i), doc and [c["text"] for c in doc["choices"]])

    async def structured(self, rng: random.Random) -> Outcome:
        i = rng.randrange(len(self.prompts))
        body: dict[str, Any] = {"model": self.model, "prompt": self.prompts[i],
                                "max_tokens": 40, "temperature": 0}
        if rng.random() < 0.5:
            out, doc = await self._post("structured", "/v1/completions",
                                        {**body, "structured_outputs": {"choice": CHOICES}})
            if doc and doc["choices"][0]["text"] not in CHOICES:
                out.problem = f"{doc['choices'][0]['text']!r} is not one of {CHOICES}"
            return self._same(out, ("choice", i), doc and doc["choices"][0]["text"])
        out, doc = await self._post("structured", "/v1/completions", {
            **body, "response_format": {"type": "json_schema", "json_schema": {
                "name": "a", "schema": SCHEMA}}})
        choice = doc["choices"][0] if doc else None
        if choice and choice["finish_reason"] == "stop":
            try:
                value = json.loads(choice["text"])
                if not isinstance(value, dict) or not isinstance(value.get("a"), int):
                    raise ValueError("does not match the schema")
            except ValueError as e:
                out.problem = f"{choice['text']!r}: {e}"
        return self._same(out, ("schema", i), choice and choice["text"])

    async def cancelled(self, rng: random.Random) -> Outcome:
        body = {"model": self.model, "prompt": rng.choice(self.prompts), "max_tokens": 200,
                "ignore_eos": True, "stream": True}
        req = HostileRequest("cancelled", "POST", "/v1/completions",
                             [("Content-Type", b"application/json")],
                             json.dumps(body).encode(), cut="stream", events=rng.randint(1, 4))
        t0 = time.monotonic()
        ans = await asyncio.to_thread(send, self.port, req)
        problem = check_answer(req, ans) or (None if ans.status == 200 else
                                             f"status {ans.status} for a valid stream")
        return Outcome("cancelled", ans.status, time.monotonic() - t0, problem)

    async def malformed(self, rng: random.Random) -> Outcome:
        req = next(self.hostile)
        t0 = time.monotonic()
        ans = await asyncio.to_thread(send, self.port, req)
        return Outcome("malformed", ans.status, time.monotonic() - t0, check_answer(req, ans))

    async def over_limit(self, rng: random.Random) -> Outcome:
        body: dict[str, Any] = rng.choice([
            {"max_tokens": self.max_model_len}, {"max_tokens": 10**6}, {"n": 129},
            {"prompt": "fox " * (2 * self.max_model_len)}, {"logprobs": 21}])
        out, _ = await self._post("over_limit", "/v1/completions", {
            "model": self.model, "prompt": "over", "max_tokens": 4, **body})
        if out.problem is None and out.status != 400:
            out.problem = f"status {out.status} for {body} (expected 400)"
        return out

    async def warm_up(self) -> list[Outcome]:
        """Every kind once, references for every prompt (not measured)."""
        rng = random.Random(0)
        outs = [await self.kinds[k](rng) for k in WEIGHTS]
        for i in range(len(self.prompts)):
            outs.append(await self.valid(random.Random(i)))
        return outs

    async def run(self, duration_s: float, concurrency: int, seed: int) -> list[Outcome]:
        end = time.monotonic() + duration_s
        outcomes: list[Outcome] = []

        async def loop(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < end:
                kind = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
                outcomes.append(await self.kinds[kind](rng))
        await asyncio.gather(*(loop(i) for i in range(concurrency)))
        return outcomes


def soak(cluster: LocalCluster, duration_s: float, concurrency: int = 4, seed: int = 0,
         max_rss_growth_mb: float = 64.0, warmup_s: float = 3.0) -> SoakResult:
    """Runs the load on a started cluster (supervising it meanwhile), then checks it."""
    model = os.path.basename(os.path.normpath(cluster.spec.model_dir))
    with _urlopen(f"http://{cluster.spec.host}:{cluster.http_port}/v1/models") as r:
        max_len = int(json.loads(r.read())["data"][0]["max_model_len"])
    load = Load(cluster.http_port, model, seed, max_len)
    result = SoakResult(duration_s, max_rss_growth_mb=max_rss_growth_mb,
                        concurrency=concurrency)
    stop = threading.Event()

    def supervise() -> None:
        while not stop.wait(0.2):
            cluster.supervise()
    thread = threading.Thread(target=supervise, daemon=True)
    thread.start()
    try:
        warm = asyncio.run(load.warm_up())
        warm += asyncio.run(load.run(warmup_s, concurrency, seed + 1))
        result.outcomes += [o for o in warm if o.problem]  # wrong even then: report it
        idle_blocks(cluster)
        result.start = sample_all(cluster)
        result.outcomes += asyncio.run(load.run(duration_s, concurrency, seed))
        blocks = idle_blocks(cluster)
    finally:
        stop.set()
        thread.join()
    result.end = sample_all(cluster)
    result.restarts = cluster.restarts
    result.leaked = {n: b.leaked if b.total >= 0 else -1 for n, b in blocks.items()}
    return result


def _urlopen(url: str) -> Any:
    import urllib.request

    return urllib.request.urlopen(url, timeout=10)


def run(args: argparse.Namespace) -> int:
    from cluster.launcher import ClusterError
    from cluster.up import build_spec

    try:
        spec = build_spec(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    spec = replace(spec, http_port=args.http_port or 0, grpc_port=args.grpc_port or 0)
    cluster = LocalCluster(spec)
    print(f"starting the cluster: {spec.num_prefill} prefill, {spec.num_decode} decode, "
          f"{spec.num_colocated} colocated (logs: {cluster.log_dir})", flush=True)
    try:
        cluster.start()
        print(f"soaking for {args.duration:g} s with {args.concurrency} client loops",
              flush=True)
        result = soak(cluster, args.duration, args.concurrency, args.seed,
                      args.max_rss_growth_mb, args.warmup)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    print(result.table())
    failures = result.failures()
    print("\ninvariants: " + ("all hold" if not failures else "BROKEN\n  "
                              + "\n  ".join(failures)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=1)
    return 1 if failures else 0
