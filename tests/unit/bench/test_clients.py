"""The OpenAI bench client's request bodies: `token_chunks` asks for the sampled token's
logprob, in each endpoint's spelling (the gateway streams a chunk per token then)."""

from __future__ import annotations

import asyncio
from typing import Any

from bench.base import BenchRequest
from bench.clients import OpenAIClient


def _bodies(req: BenchRequest, **kw: Any) -> dict[str, dict[str, Any]]:
    async def build() -> dict[str, dict[str, Any]]:
        out = {}
        for chat in (False, True):
            c = OpenAIClient("http://127.0.0.1:1", chat=chat, **kw)
            out["chat" if chat else "completions"] = c.body(req)
            await c.close()
        return out

    return asyncio.run(build())


def test_token_chunks_asks_for_the_sampled_tokens_logprob() -> None:
    req = BenchRequest(prompt="hello", prompt_len=1, output_len=4)
    plain = _bodies(req)
    assert not any("logprobs" in b or "top_logprobs" in b for b in plain.values())
    bodies = _bodies(req, token_chunks=True)
    assert bodies["completions"]["logprobs"] == 0
    assert "top_logprobs" not in bodies["completions"]
    assert (bodies["chat"]["logprobs"], bodies["chat"]["top_logprobs"]) == (True, 0)
    for name, b in bodies.items():  # the rest of the request is unchanged
        assert {k: v for k, v in b.items() if "logprobs" not in k} == plain[name]
