"""SSE framing and OpenAI object shapes as vLLM emits them."""

from __future__ import annotations

import json

from gateway.openai_format import DONE, ResponseBuilder, sse


def _decode(frame: bytes) -> dict:
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert b"\n" not in frame[:-2]
    return json.loads(frame[6:-2])


def test_sse_frames() -> None:
    assert DONE == b"data: [DONE]\n\n"
    assert _decode(sse({"a": "line\nbreak"})) == {"a": "line\nbreak"}


def test_completion_chunks_and_usage() -> None:
    b = ResponseBuilder("m", chat=False)
    c = _decode(sse(b.chunk("hi", None)))
    assert c["id"].startswith("cmpl-") and c["object"] == "text_completion"
    assert c["model"] == "m" and isinstance(c["created"], int)
    assert c["choices"] == [{"index": 0, "text": "hi", "logprobs": None,
                             "finish_reason": None, "stop_reason": None}]
    u = b.usage_chunk(3, 2, 1)
    assert u["choices"] == [] and u["id"] == c["id"]
    assert u["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
                          "prompt_tokens_details": {"cached_tokens": 1}}


def test_chat_chunks_open_with_the_assistant_role() -> None:
    b = ResponseBuilder("m", chat=True)
    first, nxt = b.chunk("", None, first=True), b.chunk("x", "stop")
    assert first["id"].startswith("chatcmpl-") and first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert nxt["choices"][0]["delta"] == {"content": "x"}
    assert nxt["choices"][0]["finish_reason"] == "stop"
    full = b.full("x", "stop", 3, 1, 0)
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["role"] == "assistant"
    assert full["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
