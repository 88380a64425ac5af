"""The choices of one OpenAI response: prompt lists x n samples, echo and logprobs.

A completion request with P prompts and `n` samples runs as P worker streams (one per
prompt, each routed on its own); the worker tags each delta with its sample `index`.
Choice `i * n + index` is prompt i's sample `index`, as vLLM numbers them. `Choices`
turns the merged deltas into SSE chunks (streaming) or one response object, with the
prompt echoed first when asked (its text, and with logprobs its tokens' logprobs, the
first one null) and usage summed over every prompt and sample.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, NamedTuple

from gateway.core import Gateway
from gateway.openai_format import (
    ResponseBuilder,
    StopReason,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
    usage,
)
from gateway.protocol import GenerateInput
from gateway.tools import ChatOutput
from protos import splitserve_pb2 as pb
from protos.convert import Logprobs, logprobs_from_proto


async def merged_streams(gw: Gateway, inps: list[GenerateInput], request_id: str,
                         deadline: float,
                         ) -> AsyncGenerator[tuple[int, pb.WorkerGenerateResponse], None]:
    """(prompt number, delta) from every prompt's worker stream, as they arrive. The
    first error of any stream is raised; closing this generator cancels them all."""
    if len(inps) == 1:
        async with contextlib.aclosing(gw.stream(inps[0], request_id, deadline)) as s:
            async for r in s:
                yield 0, r
        return
    queue: asyncio.Queue[tuple[int, pb.WorkerGenerateResponse | BaseException | None]] = \
        asyncio.Queue()

    async def pump(i: int, inp: GenerateInput) -> None:
        try:
            async with contextlib.aclosing(gw.stream(inp, f"{request_id}-{i}", deadline)) as s:
                async for r in s:
                    queue.put_nowait((i, r))
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((i, e))
        else:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, inp)) for i, inp in enumerate(inps)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def stop_reason(r: pb.WorkerGenerateResponse | pb.GenerateResponse) -> StopReason:
    """The stop string or stop token id a response says ended its sample (None: EOS,
    length, or not ended)."""
    which = r.WhichOneof("stop_reason")
    return None if which is None else getattr(r, which)  # type: ignore[no-any-return]


class Delta(NamedTuple):
    choice: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprobs | None]  # aligned with token_ids (None: no logprob)
    offset: int  # text_offset of its first token
    generated: list[int]  # the worker's new output ids (no echoed prompt)
    first: bool  # the choice's first delta


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)  # generated only (return_token_ids)
    logprobs: list[Logprobs | None] = field(default_factory=list)
    output_chars: int = 0  # generated text so far (vLLM's streaming text_offset base)
    started: bool = False
    finish_reason: str | None = None
    stop_reason: StopReason = None
    num_output_tokens: int = 0


class Choices:
    def __init__(self, inps: list[GenerateInput], b: ResponseBuilder,
                 decode: Callable[[list[int]], str]) -> None:
        self.inps = inps
        self.b = b
        self.n = inps[0].params.n
        self.choices = [_Choice() for _ in range(len(inps) * self.n)]
        self.cached = [0] * len(inps)
        # Chat with tools: each choice's text is read for tool calls (gateway/tools.py).
        tools = inps[0].tools if b.chat else None
        self.tools = [ChatOutput(tools) for _ in self.choices] if tools is not None else []
        self._decode = self._text = lru_cache(maxsize=4096)(lambda t: decode([t]))
        self.prompt_lps: list[list[Logprobs] | None] = [None] * len(inps)
        if inps[0].tokens_as_ids:  # vLLM's return_tokens_as_token_ids
            self._decode = lambda t: f"token_id:{t}"  # type: ignore[assignment]

    @property
    def logprobs(self) -> int | None:
        return self.inps[0].params.logprobs

    def add(self, prompt: int, r: pb.WorkerGenerateResponse) -> Delta:
        """Records a worker delta; returns what to show of it (the echoed prompt first
        on a choice's first delta)."""
        inp = self.inps[prompt]
        i = prompt * self.n + r.index
        c = self.choices[i]
        self.cached[prompt] = r.num_cached_tokens
        c.num_output_tokens = r.num_output_tokens
        c.finish_reason = r.finish_reason or None
        c.stop_reason = stop_reason(r)
        text, ids = r.text, list(r.token_ids)
        lps: list[Logprobs | None] = list(logprobs_from_proto(list(r.logprobs)))
        if len(r.prompt_logprobs) and self.prompt_lps[prompt] is None:
            self.prompt_lps[prompt] = logprobs_from_proto(list(r.prompt_logprobs))
        if inp.echo_only:
            text, ids, lps = "", [], []
        first, generated = not c.started and not c.output_ids, ids
        c.output_ids += generated
        offset = c.output_chars  # vLLM: streamed offsets count generated text only
        c.output_chars += len(text)
        if inp.echo and not c.started and (ids or inp.echo_only):
            prompt_lps: list[Logprobs | None] = [None]
            prompt_lps += self.prompt_lps[prompt] or []
            text, ids, lps = inp.prompt_text + text, inp.prompt_token_ids + ids, prompt_lps + lps
        c.started = c.started or bool(ids)
        c.text.append(text)
        c.token_ids += ids
        c.logprobs += lps
        return Delta(i, text, ids, lps, offset, generated, first)

    def opening(self, index: int) -> dict[str, Any]:
        """A chat stream's first chunk of choice `index` (the assistant role)."""
        out = self.b.chunk("", None, first=True, index=index)
        if self.inps[0].return_token_ids:  # vLLM: the chat stream's first chunk has them
            out["prompt_token_ids"] = self.inps[index // self.n].prompt_token_ids
        return self._with_usage(out, index, 0)

    def echo_chunks(self) -> list[dict[str, Any]]:
        """Chat `echo`: after the role chunks, each choice's echoed content (vLLM's)."""
        echo = self.inps[0].chat_echo
        if not (self.b.chat and echo):
            return []
        return [self._with_usage(self.b.chunk(echo, None, index=i), i, 0)
                for i in range(len(self.choices))]

    def chunk(self, d: Delta) -> dict[str, Any] | None:
        """The SSE chunk for a delta (None: nothing to show)."""
        finish = self.choices[d.choice].finish_reason
        k = self.logprobs
        ids = self.inps[0].return_token_ids
        delta = None
        if self.tools:
            delta, finish = self.tools[d.choice].stream(d.text, finish)
            if delta is None and not (finish or (k is not None or ids) and d.token_ids):
                return None
            delta = delta or {}
        elif not (d.text or finish or ((k is not None or ids) and d.token_ids)):
            return None
        lps = None if k is None else self._logprobs(d.token_ids, d.logprobs, k, d.offset)
        out = self.b.chunk(d.text, finish, index=d.choice, logprobs=lps, delta=delta,
                           stop_reason=self.choices[d.choice].stop_reason)
        if ids:
            choice = out["choices"][0]
            choice["token_ids"] = d.generated
            if not self.b.chat and d.first:
                choice["prompt_token_ids"] = self.inps[d.choice // self.n].prompt_token_ids
        return self._with_usage(out, d.choice)

    def _with_usage(self, chunk: dict[str, Any], index: int,
                    completion: int | None = None) -> dict[str, Any]:
        """stream_options.continuous_usage_stats: on every chunk, the usage of its choice
        `index` so far (its prompt; `completion` or its tokens), as vLLM's."""
        if self.inps[0].continuous_usage:
            prompt = index // self.n
            done = self.choices[index].num_output_tokens if completion is None else completion
            chunk["usage"] = usage(len(self.inps[prompt].prompt_token_ids), done,
                                   self.cached[prompt])
        return chunk

    def _logprobs(self, ids: list[int], lps: list[Logprobs | None], k: int, offset: int,
                  ) -> dict[str, Any]:
        if self.b.chat:
            return chat_logprobs(self._decode, ids, [lp for lp in lps if lp is not None], k,
                                 self._text)
        return completion_logprobs(self._decode, ids, lps, k, offset)

    def full(self) -> dict[str, Any]:
        """The non-streamed response: every choice whole, usage summed."""
        k = self.logprobs
        out = []
        for i, c in enumerate(self.choices):
            text: str | None = "".join(c.text)
            finish, calls = c.finish_reason, None
            if self.tools:
                text, calls, finish = self.tools[i].message(text or "", finish)
            if self.inps[0].chat_echo:
                text = self.inps[0].chat_echo + (text or "")
            out.append(self.b.choice(text, finish, index=i, tool_calls=calls,
                                     logprobs=None if k is None else self._logprobs(
                                         c.token_ids, c.logprobs, k, 0),
                                     stop_reason=c.stop_reason))
            if not self.b.chat:
                out[-1]["prompt_logprobs"] = self._prompt_logprobs(i // self.n)
            if self.inps[0].return_token_ids:
                out[-1]["token_ids"] = c.output_ids
                if not self.b.chat:
                    out[-1]["prompt_token_ids"] = self.inps[i // self.n].prompt_token_ids
        full = self.b.full_choices(out, *self.usage())
        if self.b.chat:  # vLLM's ChatCompletionResponse: null when not asked for
            full["prompt_logprobs"] = self._prompt_logprobs(0)
        if self.inps[0].return_token_ids and self.b.chat:
            full["prompt_token_ids"] = self.inps[0].prompt_token_ids
        return full

    def _prompt_logprobs(self, prompt: int) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's `prompt_logprobs` of prompt `prompt`, when the request asked for them."""
        k = self.inps[prompt].params.prompt_logprobs
        lps = self.prompt_lps[prompt]
        if k is None or lps is None:
            return None
        return prompt_logprobs_json(self._text, lps, k)

    def usage(self) -> tuple[int, int, int]:
        """(prompt tokens, completion tokens, cached tokens) over every prompt and sample."""
        return (sum(len(inp.prompt_token_ids) for inp in self.inps),
                sum(c.num_output_tokens for c in self.choices), sum(self.cached))
