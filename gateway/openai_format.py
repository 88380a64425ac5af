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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

DONE = b"data: [DONE]\n\n"

# vLLM's `stop_reason`: the stop string or stop token id that ended a choice; None for
# EOS, length and the rest.
StopReason = int | str | None


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
              index: int = 0, logprobs: dict[str, Any] | None = None,
              delta: dict[str, Any] | None = None,
              stop_reason: StopReason = None) -> dict[str, Any]:
        """`delta`: a chat delta other than plain content (tool calls, gateway/tools.py);
        `stop_reason`: the stop string / token id that ended the choice (vLLM's)."""
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = stop_reason
            return self._head("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": finish_reason, "stop_reason": stop_reason}
        return self._head("text_completion") | {"choices": [choice], "usage": None}

    def usage_chunk(self, prompt: int, completion: int, cached: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(obj) | {"choices": [], "usage": usage(prompt, completion, cached)}

    def full(self, text: str, finish_reason: str | None, prompt: int, completion: int,
             cached: int) -> dict[str, Any]:
        return self.full_choices([self.choice(text, finish_reason)], prompt, completion,
                                 cached)

    def choice(self, text: str | None, finish_reason: str | None, index: int = 0,
               logprobs: dict[str, Any] | None = None,
               tool_calls: list[dict[str, Any]] | None = None,
               stop_reason: StopReason = None) -> dict[str, Any]:
        """One choice of a non-streamed response (chat: `text` is the content, None
        beside tool calls)."""
        if self.chat:
            return {"index": index, "message": {"role": "assistant", "content": text,
                                                "tool_calls": tool_calls or []},
                    "logprobs": logprobs, "finish_reason": finish_reason,
                    "stop_reason": stop_reason}
        return {"index": index, "text": text, "logprobs": logprobs,
                "finish_reason": finish_reason, "stop_reason": stop_reason,
                "prompt_logprobs": None}

    def full_choices(self, choices: list[dict[str, Any]], prompt: int, completion: int,
                     cached: int) -> dict[str, Any]:
        head = self._head("chat.completion" if self.chat else "text_completion")
        return head | {"choices": choices, "usage": usage(prompt, completion, cached)}


# -- logprobs, as vLLM renders them ----------------------------------------------------
# Per position the engine's dict holds the chosen token first, then the top k (a chosen
# token among them keeps the first place); None is a position without logprobs (the
# prompt's first token).

Logprobs = dict[int, float]


def _lp(v: float) -> float:
    return max(v, -9999.0)  # -inf is not JSON; OpenAI's floor


def completion_logprobs(decode: Callable[[int], str], token_ids: Sequence[int],
                        lps: Sequence[Logprobs | None], k: int, offset: int = 0,
                        ) -> dict[str, Any]:
    """/v1/completions `logprobs`: tokens, token_logprobs, top_logprobs (up to k + 1
    entries: the chosen token and the top k) and text_offset from `offset` on."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for tok, lp in zip(token_ids, lps, strict=True):
        text = decode(tok)
        offsets.append(offset if not offsets else offsets[-1] + len(tokens[-1]))
        tokens.append(text)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_lp(lp[tok]))
        tops.append({decode(t): _lp(v) for i, (t, v) in enumerate(lp.items()) if i <= k})
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens,
            "top_logprobs": tops}


def chat_logprobs(decode: Callable[[int], str], token_ids: Sequence[int],
                  lps: Sequence[Logprobs], k: int,
                  text: Callable[[int], str] | None = None) -> dict[str, Any]:
    """/v1/chat/completions `logprobs`: {"content": [{token, logprob, bytes,
    top_logprobs: the dict's first k entries}]}. `decode` names a token, `text` is its
    text (they differ under return_tokens_as_token_ids): as vLLM, a chosen token's
    bytes are its text's, a top entry's its name's."""
    text = text or decode

    def entry(t: int, v: float, raw: str | None = None) -> dict[str, Any]:
        name = decode(t)
        return {"token": name, "logprob": _lp(v),
                "bytes": list((name if raw is None else raw).encode("utf-8",
                                                                    errors="replace"))}

    return {"content": [entry(tok, lp[tok], text(tok)) | {"top_logprobs": [
        entry(t, v) for i, (t, v) in enumerate(lp.items()) if i < k]}
        for tok, lp in zip(token_ids, lps, strict=True)]}


def prompt_logprobs_json(decode: Callable[[int], str], lps: Sequence[Logprobs], k: int,
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token
    {id: {logprob, rank, decoded_token}}, the prompt token first (its rank among all
    tokens, a RankedLogprobs') and the top k ranked 1..k (a prompt token among them
    takes its place there, as in vLLM's dict); -inf as -9999."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for lp in lps:
        items = list(lp.items())
        # The top k: after the prompt token, unless it is one of them (then k entries).
        top = items[1:] if len(items) > k else sorted(items, key=lambda kv: -kv[1])
        ranks = {t: i + 1 for i, (t, _) in enumerate(top)}
        own = getattr(lp, "rank", None)
        out.append({str(t): {"logprob": _lp(v), "rank": ranks.get(t, own),
                             "decoded_token": decode(t)} for t, v in items})
    return out


def model_list(name: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{
        "id": name, "object": "model", "created": created, "owned_by": "splitserve",
        "root": name, "parent": None, "max_model_len": max_model_len}]}
