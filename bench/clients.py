"""Clients the harness measures with, registered by name in `CLIENTS`.

- `openai`: POST /v1/completions with `stream: true` and
  `stream_options.include_usage` (token-id or text prompts) - splitserve's gateway,
  vLLM, SGLang or any OpenAI-compatible server. With `token_chunks` it also asks for the
  sampled token's logprob, so every token makes a chunk, text or not (see there).
- `openai-chat`: POST /v1/chat/completions (text prompts as one user message).
- `grpc`: splitserve's `splitserve.v1.Generate` server stream.

Timing follows `vllm bench serve`: TTFT is send -> first chunk with choices, ITL the
gaps between later such chunks (a chunk may carry several tokens, or none whose text
is complete yet), E2E send -> end of stream. Output tokens come from
the server's usage report (gRPC: token ids counted exactly); cached tokens from
`usage.prompt_tokens_details.cached_tokens`. Every request has a deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from bench.base import BenchError, BenchRequest, Client, RequestResult
from bench.sse import SSEDecoder, parse_chunk


class _Timer:
    """Collects a request's timestamps; `result()` builds the RequestResult."""

    def __init__(self, req: BenchRequest) -> None:
        self.req = req
        self.t0 = time.perf_counter()
        self.last: float | None = None
        self.ttft: float | None = None
        self.itl: list[float] = []
        self.chunks = 0

    def content(self) -> None:
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.t0
        elif self.last is not None:
            self.itl.append(now - self.last)
        self.last = now
        self.chunks += 1

    def result(self, out_tokens: int | None, cached: int | None, error: str = "",
               ) -> RequestResult:
        ok = not error and self.ttft is not None
        if not error and self.ttft is None:
            error = "the stream ended without any output"
        return RequestResult(
            ok=ok, prompt_len=self.req.prompt_len,
            output_len=(out_tokens if out_tokens is not None else self.chunks) if ok else 0,
            start_s=self.t0,  # absolute; the runner makes it relative
            ttft_s=self.ttft if ok else None,
            e2e_s=time.perf_counter() - self.t0 if ok else None, itl_s=self.itl if ok else [],
            cached_tokens=cached or 0, error=error, tag=self.req.tag)


class OpenAIClient:
    """Streaming OpenAI HTTP client over one aiohttp session (connection reuse)."""

    def __init__(self, url: str, model: str = "", chat: bool = False, api_key: str = "",
                 timeout_s: float = 300.0, token_chunks: bool = False) -> None:
        """`token_chunks`: ask for the sampled token's logprob (completions `logprobs: 0`,
        chat `logprobs: true, top_logprobs: 0`). A server sends no chunk for a token
        whose text is not complete yet, and a model shape's dummy weights sample ids the
        embedded tokenizer (687 tokens) mostly has no text for: without it, TTFT there is
        the first printable token's time (often the end of the stream). With it, a chunk
        per token, so TTFT and ITL time tokens."""
        import aiohttp

        if not url.startswith(("http://", "https://")):
            raise BenchError(f"an OpenAI backend needs an http(s):// URL, got {url!r}")
        self.name = "openai-chat" if chat else "openai"
        self.url = url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
        self.model, self.chat, self.timeout_s = model, chat, timeout_s
        self.token_chunks = token_chunks
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s, connect=10.0),
            connector=aiohttp.TCPConnector(limit=0))

    def body(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0}
        if self.model:
            body["model"] = self.model
        if self.chat:
            if not isinstance(req.prompt, str):
                raise BenchError("the chat endpoint needs text prompts (use `openai` for "
                                 "token-id prompts)")
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
        if self.token_chunks:
            body |= {"logprobs": True, "top_logprobs": 0} if self.chat else {"logprobs": 0}
        return body

    async def send(self, req: BenchRequest) -> RequestResult:
        import aiohttp

        timer = _Timer(req)
        out_tokens = cached = None
        try:
            async with self._session.post(self.url, json=self.body(req)) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    return timer.result(None, None, f"HTTP {resp.status}: {text}")
                decoder = SSEDecoder()
                async for data in resp.content.iter_any():
                    for payload in decoder.feed(data):
                        c = parse_chunk(payload)
                        if c.error:
                            return timer.result(None, None, c.error)
                        if c.has_choices:  # as vLLM's bench: text may be empty
                            timer.content()
                        if c.completion_tokens is not None:
                            out_tokens, cached = c.completion_tokens, c.cached_tokens
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return timer.result(None, None, f"{type(e).__name__}: {e}"[:300])
        return timer.result(out_tokens, cached)

    async def close(self) -> None:
        await self._session.close()


class GrpcClient:
    """splitserve's gRPC Generate (token ids or text prompts)."""

    def __init__(self, address: str, model: str = "", timeout_s: float = 300.0) -> None:
        import grpc

        from protos import splitserve_pb2_grpc as pb_grpc

        self.name = "grpc"
        self.model, self.timeout_s = model, timeout_s
        self._channel = grpc.aio.insecure_channel(address.removeprefix("grpc://"))
        self._stub = pb_grpc.GenerateStub(self._channel)

    def request(self, req: BenchRequest) -> Any:
        from protos import splitserve_pb2 as pb

        sampling = pb.SamplingParams(max_tokens=req.output_len, temperature=0.0,
                                     ignore_eos=True)
        if isinstance(req.prompt, str):
            return pb.GenerateRequest(model=self.model, prompt=req.prompt, sampling=sampling)
        return pb.GenerateRequest(model=self.model, sampling=sampling,
                                  token_ids=pb.TokenIds(ids=list(req.prompt)))

    async def send(self, req: BenchRequest) -> RequestResult:
        import grpc

        timer = _Timer(req)
        n_out, cached = 0, None
        try:
            call = self._stub.Generate(self.request(req), timeout=self.timeout_s)
            async for r in call:
                if r.token_ids:
                    timer.content()
                    n_out += len(r.token_ids)
                if r.finish_reason:
                    if r.finish_reason in ("error", "abort"):
                        return timer.result(None, None, f"finish_reason={r.finish_reason}")
                    cached = r.usage.cached_tokens
                    n_out = r.usage.completion_tokens or n_out
        except grpc.aio.AioRpcError as e:
            return timer.result(None, None, f"{e.code().name}: {e.details()}"[:300])
        return timer.result(n_out, cached)

    async def close(self) -> None:
        await self._channel.close()


def make_client(backend: str, url: str, **kw: Any) -> Client:
    """`backend` is one of CLIENTS; `url` is http(s)://host:port or host:port for gRPC."""
    if backend not in CLIENTS:
        raise BenchError(f"unknown backend {backend!r}; known: {sorted(CLIENTS)}")
    return CLIENTS[backend](url, **kw)


CLIENTS: dict[str, Callable[..., Client]] = {
    "openai": lambda url, **kw: OpenAIClient(url, **kw),
    "openai-chat": lambda url, **kw: OpenAIClient(url, chat=True, **kw),
    "grpc": lambda url, **kw: GrpcClient(url, **kw),
}
