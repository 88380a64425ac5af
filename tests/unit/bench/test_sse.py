"""The SSE parser reads splitserve's gateway stream (built by the gateway's own
formatter) and vLLM's streams (completions and chat, in the exact shape vLLM's OpenAI
server writes them: `usage: null` on token chunks, a `choices: []` usage chunk, then
`[DONE]`), however the bytes are split."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.sse import SSEDecoder, parse_chunk
from gateway.openai_format import DONE, ResponseBuilder, sse

DATA = Path(__file__).parent / "data"


def decode(raw: bytes, step: int) -> list[str]:
    d = SSEDecoder()
    events: list[str] = []
    for i in range(0, len(raw), step):
        events += d.feed(raw[i:i + step])
    return events + d.flush()


def read_stream(raw: bytes, step: int) -> tuple[str, int, int | None, int | None, bool]:
    """(text, token chunks, completion tokens, cached tokens, saw [DONE])."""
    text, chunks, out, cached, done = "", 0, None, None, False
    for payload in decode(raw, step):
        c = parse_chunk(payload)
        assert c.error is None, c.error
        text += c.text
        chunks += c.has_choices
        done |= c.done
        if c.completion_tokens is not None:
            out, cached = c.completion_tokens, c.cached_tokens
    return text, chunks, out, cached, done


@pytest.mark.parametrize("step", [1, 3, 7, 64, 100_000])
def test_gateway_stream(step: int) -> None:
    b = ResponseBuilder(model="tiny", chat=False)
    raw = b"".join([sse(b.chunk("Hel", None)), sse(b.chunk("lo wörld", None)),
                    sse(b.chunk("!", "length")), sse(b.usage_chunk(12, 3, 8)), DONE])
    assert read_stream(raw, step) == ("Hello wörld!", 3, 3, 8, True)


@pytest.mark.parametrize("step", [1, 5, 4096])
def test_gateway_chat_stream(step: int) -> None:
    b = ResponseBuilder(model="tiny", chat=True)
    raw = b"".join([sse(b.chunk("", None, first=True)), sse(b.chunk("Hi", None)),
                    sse(b.chunk("", "stop")), sse(b.usage_chunk(5, 1, 0)), DONE])
    assert read_stream(raw, step) == ("Hi", 3, 1, 0, True)


@pytest.mark.parametrize("step", [1, 2, 13, 100_000])
def test_vllm_completions_stream(step: int) -> None:
    raw = (DATA / "vllm_completions_stream.txt").read_bytes()
    assert read_stream(raw, step) == (" The capital of France", 4, 4, 0, True)


@pytest.mark.parametrize("step", [1, 9, 100_000])
def test_vllm_chat_stream(step: int) -> None:
    raw = (DATA / "vllm_chat_stream.txt").read_bytes()
    assert read_stream(raw, step) == ("Paris.", 3, 2, 16, True)


def test_crlf_multiline_comments_and_fields() -> None:
    raw = b": keep-alive\r\nevent: message\r\nid: 7\r\ndata: a\r\ndata:b\r\n\r\ndata: c\r\rdata: d\n"
    for step in (1, 2, 100):
        assert decode(raw, step) == ["a\nb", "c", "d"]


def test_usage_without_details_and_errors() -> None:
    c = parse_chunk('{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,'
                    '"prompt_tokens_details":null}}')
    assert (c.completion_tokens, c.cached_tokens, c.has_choices) == (2, None, False)
    assert parse_chunk('{"error":{"message":"overloaded","code":429}}').error == "overloaded"
    assert parse_chunk("not json").error is not None
