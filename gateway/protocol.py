"""OpenAI request bodies -> validated `GenerateInput` (token ids + SamplingParams).

Everything here runs before any routing: a bad request never reaches a worker. Unknown
fields are ignored, as vLLM does. Errors
are InvalidRequest (400) or ModelNotFound (404) with vLLM's messages where vLLM has
one. `ModelContext` owns the tokenizer and the model's limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from gateway.errors import InvalidRequest, ModelNotFound


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


class ModelContext:
    """The served model as the gateway knows it (torch-free)."""

    def __init__(self, model_dir: str, served_name: str, max_model_len: int | None = None,
                 ) -> None:
        cfg = ModelConfig.from_model_dir(model_dir)
        self.served_name = served_name
        self.tokenizer = Tokenizer(model_dir)
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


def sampling_from_body(body: dict[str, Any], max_tokens_keys: tuple[str, ...]) -> tuple[
        SamplingParams, bool]:
    """Returns (params, max_tokens_given). Checks types and ranges (not the context)."""
    n = _get(body, "n", int, 1)
    if n != 1:
        raise InvalidRequest("only n=1 is supported", "n")
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
        skip_special_tokens=_get(body, "skip_special_tokens", bool, True))
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


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def parse_completion(body: Any, ctx: ModelContext) -> GenerateInput:
    body = _object(body)
    model = ctx.check_model(body.get("model"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = ctx.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in prompt):
        ids = list(prompt)
    else:
        raise InvalidRequest("`prompt` must be a string or a list of token ids (batches of "
                             "several prompts are not supported)", "prompt")
    params, given = sampling_from_body(body, ("max_tokens",))
    return finish_input(ctx, model, ids, params, given, **_stream_flags(body))


def _message_text(m: Any, i: int) -> dict[str, str]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise InvalidRequest(f"messages[{i}] must be an object with a string `role`",
                             "messages")
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
    return {"role": m["role"], "content": content}


def parse_chat(body: Any, ctx: ModelContext) -> GenerateInput:
    body = _object(body)
    model = ctx.check_model(body.get("model"))
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest("`messages` must be a non-empty list", "messages")
    messages = [_message_text(m, i) for i, m in enumerate(msgs)]
    try:
        ids = ctx.tokenizer.encode_chat(
            messages, add_generation_prompt=_get(body, "add_generation_prompt", bool, True))
    except ValueError as e:
        raise InvalidRequest(str(e), "messages") from e
    params, given = sampling_from_body(body, ("max_completion_tokens", "max_tokens"))
    return finish_input(ctx, model, ids, params, given, **_stream_flags(body))
