"""Server-sent events: an incremental decoder (bytes in, event payloads out) and the
reading of OpenAI completion / chat chunks as vLLM and splitserve's gateway send them.

The decoder follows the SSE spec: lines end in LF, CRLF or CR; `data:` lines (one
optional space after the colon) accumulate until a blank line dispatches the event;
`:` lines are comments; other fields (event, id, retry) are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


class SSEDecoder:
    """Feed network chunks in any split; get complete event payloads out."""

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []
        self._pending = b""

    def feed(self, chunk: bytes) -> list[str]:
        raw = self._pending + chunk
        try:
            text = raw.decode("utf-8")
            self._pending = b""
        except UnicodeDecodeError as e:  # a multi-byte character split across chunks
            text = raw[:e.start].decode("utf-8")
            self._pending = raw[e.start:]
        self._buf += text
        events: list[str] = []
        while True:
            line, sep, rest = self._next_line(self._buf)
            if not sep:
                return events
            self._buf = rest
            if line == "":
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith(":"):
                continue
            else:
                name, _, value = line.partition(":")
                if name == "data":
                    self._data.append(value[1:] if value.startswith(" ") else value)

    @staticmethod
    def _next_line(buf: str) -> tuple[str, str, str]:
        for i, ch in enumerate(buf):
            if ch == "\n":
                return buf[:i], "\n", buf[i + 1:]
            if ch == "\r":
                if i + 1 == len(buf):
                    return "", "", buf  # could be half of CRLF: wait for more
                if buf[i + 1] == "\n":
                    return buf[:i], "\r\n", buf[i + 2:]
                return buf[:i], "\r", buf[i + 1:]
        return "", "", buf

    def flush(self) -> list[str]:
        """The last event of a stream that ended without a blank line."""
        tail = self.feed(b"\n\n") if self._buf or self._data else []
        return tail


@dataclass(slots=True)
class Chunk:
    """What one OpenAI stream chunk says: text delta, finish reason, usage, error."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    done: bool = False
    has_choices: bool = False  # a token-bearing chunk (vLLM's bench times these)


def parse_chunk(payload: str) -> Chunk:
    """Reads a completion or chat-completion chunk (or `[DONE]`, or an error object)."""
    if payload.strip() == DONE:
        return Chunk(done=True)
    try:
        obj: Any = json.loads(payload)
    except ValueError:
        return Chunk(error=f"not JSON: {payload[:80]!r}")
    if not isinstance(obj, dict):
        return Chunk(error=f"not a JSON object: {payload[:80]!r}")
    if "error" in obj:
        err = obj["error"]
        return Chunk(error=str(err.get("message", err) if isinstance(err, dict) else err))
    out = Chunk(has_choices=bool(obj.get("choices")))
    for choice in obj.get("choices") or []:
        if "text" in choice:
            out.text += choice.get("text") or ""
        delta = choice.get("delta") or {}
        out.text += delta.get("content") or ""
        out.finish_reason = choice.get("finish_reason") or out.finish_reason
    usage = obj.get("usage")
    if isinstance(usage, dict):
        out.prompt_tokens = usage.get("prompt_tokens")
        out.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        out.cached_tokens = (details or {}).get("cached_tokens") if isinstance(
            details, dict) or details is None else None
    return out
