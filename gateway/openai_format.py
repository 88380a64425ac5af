"""OpenAI response objects and SSE framing, shaped exactly as vLLM emits them.

Stream: `data: <json>\\n\\n` per chunk, then (with stream_options.include_usage) one
chunk with `"choices": []` and `usage`, then `data: [DONE]\\n\\n`. Chat streams open
with a delta carrying `role: assistant`. `usage.prompt_tokens_details.cached_tokens`
is always present.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() \
        + b"\n\n"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass(slots=True)
class ResponseBuilder:
    """Builds one request's response objects; `chat` picks the chat shapes."""

    model: str
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str, finish_reason: str | None, first: bool = False,
              ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first \
                else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._head("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": None}
        return self._head("text_completion") | {"choices": [choice]}

    def usage_chunk(self, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(obj) | {"choices": [], "usage": usage(prompt, completion, cached)}

    def full(self, text: str, finish_reason: str | None, prompt: int, completion: int,
             cached: int) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": text,
                                        "tool_calls": []},
                "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": finish_reason, "stop_reason": None,
                      "prompt_logprobs": None}
            head = self._head("text_completion")
        return head | {"choices": [choice], "usage": usage(prompt, completion, cached)}


def model_list(name: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{
        "id": name, "object": "model", "created": created, "owned_by": "splitserve",
        "root": name, "parent": None, "max_model_len": max_model_len}]}
