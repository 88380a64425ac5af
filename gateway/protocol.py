"""OpenAI request bodies -> validated `GenerateInput` (token ids + SamplingParams).

Everything here runs before any routing: a bad request never reaches a worker. Parameters
we do not implement are refused and unknown fields logged and ignored (gateway/params.py).
Errors are InvalidRequest (400) or ModelNotFound (404) with vLLM's messages where vLLM has
one. `ModelContext` owns the tokenizer and the model's limits.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from engine.config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from gateway.errors import InvalidRequest, ModelNotFound
from gateway.params import check_fields
from gateway.structured import structured_from_body
from gateway.tool_parsers import PARSERS, default_parser
from gateway.tools import ToolChoice, forced_structure, message_tool_fields, parse_tools


@dataclass(slots=True)
class GenerateInput:
    """One validated request, ready to route."""

    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    priority: int = 0
    tenant: str = ""  # set by the front from the request's identity (gateway/identity.py)
    labels: dict[str, str] = field(default_factory=dict)
    # /v1/completions `echo`: the prompt (its text; with logprobs, its tokens' logprobs)
    # comes first; `echo_only` (max_tokens 0): the prompt alone, nothing generated shown.
    echo: bool = False
    echo_only: bool = False
    prompt_text: str = ""
    tools: ToolChoice | None = None  # chat: how to read tool calls out of the output


class ModelContext:
    """The served model as the gateway knows it (torch-free)."""

    def __init__(self, model_dir: str, served_name: str, max_model_len: int | None = None,
                 tool_call_parser: str = "auto") -> None:
        """`tool_call_parser`: the format tool calls take in this model's output (a
        name in gateway/tool_parsers.PARSERS), "auto" (from the chat template) or
        "none" (tool_choice "auto" refused)."""
        cfg = ModelConfig.from_model_dir(model_dir)
        self.served_name = served_name
        self.tokenizer = Tokenizer(model_dir)
        if tool_call_parser not in (*PARSERS, "auto", "none"):
            raise ValueError(f"unknown tool call parser {tool_call_parser!r}; choose from "
                             f"{', '.join(PARSERS)}, auto, none")
        self.tool_parser = default_parser(self.tokenizer.chat_template) \
            if tool_call_parser == "auto" else None if tool_call_parser == "none" \
            else tool_call_parser
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size

    def observe_worker_limit(self, max_model_len: int) -> None:
        """A worker serves at most `max_model_len` tokens (its --max-model-len): the
        gateway validates against the smallest limit seen, so a request it accepts fits
        every worker. Only ever lowers the limit."""
        if 0 < max_model_len < self.max_model_len:
            self.max_model_len = max_model_len

    def check_model(self, model: Any) -> str:
        if model is None or model == "":
            return self.served_name
        if model != self.served_name:
            raise ModelNotFound(f"The model `{model}` does not exist.", "model")
        return self.served_name


def _get(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) and kind is not bool and bool not in (
            kind if isinstance(kind, tuple) else (kind,)):
        raise InvalidRequest(f"`{key}` must be of type {_kind_name(kind)}, got a boolean", key)
    if not isinstance(v, kind):
        raise InvalidRequest(f"`{key}` must be of type {_kind_name(kind)}, got {v!r}", key)
    return v


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "integer", float: "number", bool: "boolean", str: "string",
                        list: "array", dict: "object"}.get(k, k.__name__) for k in kinds)


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise InvalidRequest("`stop` must be null, a string or a list of strings", "stop")


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = float(_get(body, key, (int, float), default))
    if not lo <= v <= hi:  # also rejects NaN
        raise InvalidRequest(f"`{key}` must be in [{lo:g}, {hi:g}], got {v}", key)
    return v


def _count(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = _get(body, key, int, None)
    if v is not None and not lo <= v <= hi:
        raise InvalidRequest(f"`{key}` must be in [{lo}, {hi}], got {v}", key)
    return v


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's {"token id": bias} (keys are strings in JSON), biases in [-100, 100]."""
    out = {}
    for k, v in (_get(body, "logit_bias", dict, None) or {}).items():
        try:
            tok = int(k)
        except ValueError:
            raise InvalidRequest(f"`logit_bias` keys must be token ids, got {k!r}",
                                 "logit_bias") from None
        if isinstance(v, bool) or not isinstance(v, int | float) or not -100 <= v <= 100:
            raise InvalidRequest(f"`logit_bias` values must be numbers in [-100, 100], got "
                                 f"{v!r}", "logit_bias")
        out[tok] = float(v)
    return out


def _classic(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """n, best_of, logprobs, penalties, logit_bias, min_tokens as SamplingParams fields."""
    n = _count(body, "n", 1, MAX_SAMPLES)
    best_of = None if chat else _count(body, "best_of", 1, MAX_SAMPLES)
    if best_of is not None and best_of < (n or 1):
        raise InvalidRequest(f"`best_of` must be at least `n` ({n}), got {best_of}", "best_of")
    if best_of is not None and best_of > (n or 1) and body.get("stream"):
        raise InvalidRequest("`best_of` cannot be used with `stream`", "best_of")
    if chat:
        top = _count(body, "top_logprobs", 0, MAX_LOGPROBS)
        if not _get(body, "logprobs", bool, False):
            if top:
                raise InvalidRequest("`top_logprobs` needs `logprobs` set to true",
                                     "top_logprobs")
            logprobs = None
        else:
            logprobs = top or 0
    else:
        logprobs = _count(body, "logprobs", 0, MAX_LOGPROBS)
    min_tokens = _count(body, "min_tokens", 0, 2**31 - 1) or 0
    return {"n": n or 1, "best_of": best_of, "logprobs": logprobs,
            "prompt_logprobs": logprobs if not chat and _get(body, "echo", bool, False)
            else None,
            "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
            "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
            "repetition_penalty": _number(body, "repetition_penalty", 1.0, 1e-6, 2.0),
            "logit_bias": _logit_bias(body), "min_tokens": min_tokens}


MAX_SAMPLES = 128  # n / best_of
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def sampling_from_body(body: dict[str, Any], max_tokens_keys: tuple[str, ...],
                       chat: bool = False) -> tuple[SamplingParams, bool]:
    """Returns (params, max_tokens_given). Checks types and ranges (not the context)."""
    max_tokens = None
    for key in max_tokens_keys:
        max_tokens = _get(body, key, int, None)
        if max_tokens is not None:
            if max_tokens <= 0:
                raise InvalidRequest(f"`{key}` must be at least 1, got {max_tokens}", key)
            break
    top_k = _get(body, "top_k", int, None)
    if top_k is not None and top_k < -1:
        raise InvalidRequest(f"`top_k` must be -1 (disable) or at least 0, got {top_k}", "top_k")
    stop_ids = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise InvalidRequest("`stop_token_ids` must be a list of integers", "stop_token_ids")
    params = SamplingParams(
        max_tokens=max_tokens or 1,  # placeholder until the prompt length is known
        temperature=float(_get(body, "temperature", (int, float), 1.0)),
        top_p=float(_get(body, "top_p", (int, float), 1.0)),
        top_k=None if top_k in (None, -1, 0) else top_k,
        seed=_get(body, "seed", int, None),
        stop=_stop(body), stop_token_ids=stop_ids,
        ignore_eos=_get(body, "ignore_eos", bool, False),
        skip_special_tokens=_get(body, "skip_special_tokens", bool, True),
        **_classic(body, chat))
    if params.min_tokens and max_tokens is not None and params.min_tokens > max_tokens:
        raise InvalidRequest(f"`min_tokens` ({params.min_tokens}) must not exceed max_tokens "
                             f"({max_tokens})", "min_tokens")
    if not 0.0 <= params.temperature <= 2.0:
        raise InvalidRequest(f"`temperature` must be in [0, 2], got {params.temperature}",
                             "temperature")
    return params, max_tokens is not None


def finish_input(ctx: ModelContext, model: str, ids: list[int], params: SamplingParams,
                 max_tokens_given: bool, **kw: Any) -> GenerateInput:
    """Context-length and vocabulary checks once the prompt is tokenized."""
    if not ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    if any(not 0 <= t < ctx.vocab_size for t in ids):
        raise InvalidRequest(f"the prompt holds token ids outside [0, {ctx.vocab_size})",
                             "prompt")
    if not max_tokens_given:
        params.max_tokens = max(1, ctx.max_model_len - len(ids))
    total = len(ids) + params.max_tokens
    if total > ctx.max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {ctx.max_model_len} tokens. However, "
            f"you requested {total} tokens ({len(ids)} in the messages, {params.max_tokens} "
            f"in the completion). Please reduce the length of the messages or completion.",
            "max_tokens" if max_tokens_given else "prompt")
    try:
        params.validate(ctx.vocab_size)
    except ValueError as e:
        raise InvalidRequest(str(e)) from e
    return GenerateInput(model=model, prompt_token_ids=ids, params=params, **kw)


def _stream_flags(body: dict[str, Any]) -> dict[str, Any]:
    stream = _get(body, "stream", bool, False)
    opts = _get(body, "stream_options", dict, None)
    if opts is not None and not stream:
        raise InvalidRequest("Stream options can only be defined when `stream=True`.",
                             "stream_options")
    include_usage = bool(opts and _get(opts, "include_usage", bool, False))
    salt = _get(body, "cache_salt", str, None)
    if salt == "":
        raise InvalidRequest("`cache_salt` must be a non-empty string", "cache_salt")
    return {"stream": stream, "include_usage": include_usage, "cache_salt": salt,
            "priority": _get(body, "priority", int, 0)}


MAX_JSON_DEPTH = 64  # arrays / objects inside each other (JSON schemas stay far below)
MAX_JSON_INT = 2**64  # no field holds more; larger ones cannot even become a float


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    v = float(text)
    if math.isinf(v):
        raise ValueError(f"number {text} is out of range")
    return v


def _bounded_int(text: str) -> int:
    v = int(text)
    if not -MAX_JSON_INT < v < MAX_JSON_INT:
        raise ValueError(f"integer {text[:32]}{'...' if len(text) > 32 else ''} is out of "
                         "range (at most 64 bits)")
    return v


def parse_json(raw: bytes) -> Any:
    """A request body as strict JSON: UTF-8, finite numbers (no NaN / Infinity, none
    beyond 64-bit integers or doubles), strings of Unicode scalar values (no lone
    surrogates, which cannot be encoded again: tokenizer, protobuf, logs), nested at most
    MAX_JSON_DEPTH deep. Anything else is InvalidRequest (400) here, before any field
    is read."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float,
                          parse_int=_bounded_int)
        _check_json(body)
    except RecursionError:
        raise InvalidRequest(f"the request body is not valid JSON: nested deeper than "
                             f"{MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeError) as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    return body


def _check_json(body: Any) -> None:
    """Raises ValueError for a lone surrogate or nesting past MAX_JSON_DEPTH (iterative:
    no recursion on the client's structure)."""
    stack = [(body, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            v.encode("utf-8")  # UnicodeEncodeError (a ValueError) on a lone surrogate
            continue
        if not isinstance(v, list | dict):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        items = list(v.items()) if isinstance(v, dict) else [(None, x) for x in v]
        for k, x in items:
            if k is not None:
                k.encode("utf-8")
            stack.append((x, depth + 1))


_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")


def check_request_id(rid: str) -> str:
    """A client's request id (x-request-id, gRPC's request_id): 1-256 printable ASCII
    characters, as gRPC metadata, logs and response headers carry it unchanged."""
    if not _REQUEST_ID.fullmatch(rid):
        raise InvalidRequest("the request id (x-request-id) must be 1-256 printable ASCII "
                             "characters without spaces", "x-request-id")
    return rid


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def _token_ids(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in p)


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """`prompt`: a string, a list of token ids, or a list of either (one choice each)."""
    prompt: Any = body.get("prompt")
    if isinstance(prompt, str) or _token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p)
                                                    for p in prompt):
        return list(prompt)
    raise InvalidRequest("`prompt` must be a string, a list of token ids, or a non-empty "
                         "list of strings or of token-id lists", "prompt")


def parse_completion(body: Any, ctx: ModelContext) -> list[GenerateInput]:
    """One input per prompt, in order (the choices of prompt i are i*n .. i*n+n-1)."""
    body = _object(body)
    model = ctx.check_model(body.get("model"))
    check_fields(body, "completions")
    prompts = _prompts(body)
    echo = _get(body, "echo", bool, False)
    echo_only = echo and body.get("max_tokens") == 0
    if echo_only:  # vLLM: the prompt alone (one token is generated and not shown)
        body = body | {"max_tokens": 1}
    params, given = sampling_from_body(body, ("max_tokens",))
    params.structured = structured_from_body(body)
    special = _get(body, "add_special_tokens", bool, True)
    flags = _stream_flags(body)
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids, text = ctx.tokenizer.encode(prompt, add_special_tokens=special), prompt
        else:
            ids, text = list(prompt), ctx.tokenizer.decode(prompt, skip_special_tokens=False) \
                if echo else ""
        out.append(finish_input(ctx, model, ids, replace(params), given, echo=echo,
                                echo_only=echo_only, prompt_text=text, **flags))
    return out


def _message_text(m: Any, i: int) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise InvalidRequest(f"messages[{i}] must be an object with a string `role`",
                             "messages")
    if m["role"] not in CHAT_ROLES:
        raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got "
                             f"{m['role']!r}", "messages")
    content = m.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text" \
                    or not isinstance(p.get("text"), str):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported",
                                     "messages")
            parts.append(p["text"])
        content = "\n".join(parts)
    if not isinstance(content, str):
        raise InvalidRequest(f"messages[{i}].content must be a string or a list of text "
                             "parts", "messages")
    return {"role": m["role"], "content": content} | message_tool_fields(m, i)


def parse_chat(body: Any, ctx: ModelContext) -> GenerateInput:
    body = _object(body)
    model = ctx.check_model(body.get("model"))
    check_fields(body, "chat")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest("`messages` must be a non-empty list", "messages")
    messages = [_message_text(m, i) for i, m in enumerate(msgs)]
    tools = chat_tools(ctx, parse_tools(body.get("tools"), body.get("tool_choice"),
                                        body.get("parallel_tool_calls")))
    try:
        ids = ctx.tokenizer.encode_chat(
            messages, add_generation_prompt=_get(body, "add_generation_prompt", bool, True),
            tools=list(tools.tools) if tools else None)
    except ValueError as e:
        raise InvalidRequest(str(e), "messages") from e
    params, given = sampling_from_body(body, ("max_completion_tokens", "max_tokens"),
                                       chat=True)
    params.structured = structured_from_body(body, forced_structure(tools))
    return finish_input(ctx, model, ids, params, given, tools=tools, **_stream_flags(body))


def chat_tools(ctx: ModelContext, tools: ToolChoice | None) -> ToolChoice | None:
    """`tool_choice: auto` needs this model's tool-call format (vLLM's rule and message)."""
    if tools is None:
        return None
    if tools.mode == "auto" and ctx.tool_parser is None:
        raise InvalidRequest('"auto" tool choice requires --enable-auto-tool-choice and '
                             "--tool-call-parser to be set (this server: --tool-call-parser; "
                             "none was found for this model's chat template)", "tool_choice")
    return replace(tools, parser=ctx.tool_parser)


def parse_tokenize(body: Any, ctx: ModelContext) -> list[int]:
    """vLLM's /tokenize: `prompt` (add_special_tokens, default true) or `messages`
    (through the chat template; add_generation_prompt, default true)."""
    body = _object(body)
    ctx.check_model(body.get("model"))
    if "messages" in body:
        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise InvalidRequest("`messages` must be a non-empty list", "messages")
        try:
            return ctx.tokenizer.encode_chat(
                [_message_text(m, i) for i, m in enumerate(msgs)],
                add_generation_prompt=_get(body, "add_generation_prompt", bool, True))
        except ValueError as e:
            raise InvalidRequest(str(e), "messages") from e
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequest("give `prompt` (a string) or `messages`", "prompt")
    return ctx.tokenizer.encode(prompt, _get(body, "add_special_tokens", bool, True))


def parse_detokenize(body: Any, ctx: ModelContext) -> list[int]:
    body = _object(body)
    ctx.check_model(body.get("model"))
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequest("`tokens` must be a list of token ids", "tokens")
    if any(not 0 <= t < ctx.vocab_size for t in ids):
        raise InvalidRequest(f"`tokens` holds ids outside [0, {ctx.vocab_size})", "tokens")
    return ids
