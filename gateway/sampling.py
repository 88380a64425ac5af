"""OpenAI / vLLM sampling fields of a request body -> `SamplingParams`: types and
ranges, with vLLM's messages. The prompt's length is not known here: max_tokens is
checked against the context in gateway/protocol.finish_input.
"""

from __future__ import annotations

from typing import Any

from engine.sampling_params import SamplingParams
from gateway.body import get_field
from gateway.errors import InvalidRequest
from gateway.generation_config import SAMPLING_FIELDS, GenerationDefaults

MAX_SAMPLES = 128  # n / best_of
MAX_LOGPROBS = 20  # vLLM's default max_logprobs


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
    v = float(get_field(body, key, (int, float), default))
    if not lo <= v <= hi:  # also rejects NaN
        raise InvalidRequest(f"`{key}` must be in [{lo:g}, {hi:g}], got {v}", key)
    return v


def _count(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = get_field(body, key, int, None)
    if v is not None and not lo <= v <= hi:
        raise InvalidRequest(f"`{key}` must be in [{lo}, {hi}], got {v}", key)
    return v


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's {"token id": bias} (keys are strings in JSON); SamplingParams clamps each
    bias to [-100, 100], as vLLM's SamplingParams.from_optional does."""
    out = {}
    for k, v in (get_field(body, "logit_bias", dict, None) or {}).items():
        try:
            tok = int(k)
        except ValueError:
            raise InvalidRequest(f"`logit_bias` keys must be token ids, got {k!r}",
                                 "logit_bias") from None
        if isinstance(v, bool) or not isinstance(v, int | float) or v != v:
            raise InvalidRequest(f"`logit_bias` values must be numbers, got {v!r}",
                                 "logit_bias")
        out[tok] = float(v)
    return out


def _repetition_penalty(body: dict[str, Any]) -> float:
    """vLLM's: finite and above 0, no upper bound."""
    v = float(get_field(body, "repetition_penalty", (int, float), 1.0))
    if not 0.0 < v < float("inf"):  # also rejects NaN
        raise InvalidRequest(f"`repetition_penalty` must be a finite number above 0, got {v}",
                             "repetition_penalty")
    return v


def _prompt_logprobs(body: dict[str, Any]) -> int | None:
    """vLLM's prompt_logprobs: -1 (the whole vocabulary) or k, at most its default
    max_logprobs (20); not with streaming (above 0)."""
    k = get_field(body, "prompt_logprobs", int, None)
    if k is None:
        return None
    if body.get("stream") and (k > 0 or k == -1):
        raise InvalidRequest("`prompt_logprobs` are not available when `stream=True`.",
                             "prompt_logprobs")
    if k < -1:
        raise InvalidRequest("`prompt_logprobs` must be a positive value or -1.",
                             "prompt_logprobs")
    if k == -1 or k > MAX_LOGPROBS:
        asked = "the whole vocabulary" if k == -1 else k
        raise InvalidRequest(f"Requested prompt logprobs of {asked}, which is greater than "
                             f"max allowed: {MAX_LOGPROBS}", "prompt_logprobs")
    return k


def _classic(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """n, best_of, logprobs, penalties, logit_bias, min_tokens as SamplingParams fields."""
    n = _count(body, "n", 1, MAX_SAMPLES)
    best_of = None if chat else _count(body, "best_of", 1, MAX_SAMPLES)
    if best_of is not None and best_of < (n or 1):
        raise InvalidRequest(f"`best_of` must be at least `n` ({n}), got {best_of}", "best_of")
    if best_of is not None and best_of > (n or 1) and body.get("stream"):
        raise InvalidRequest("`best_of` cannot be used with `stream`", "best_of")
    top = 0
    if chat:
        top = _count(body, "top_logprobs", 0, MAX_LOGPROBS) or 0
        if not get_field(body, "logprobs", bool, False):
            if top:
                raise InvalidRequest("`top_logprobs` needs `logprobs` set to true",
                                     "top_logprobs")
            logprobs = None
        else:
            logprobs = top
    else:
        logprobs = _count(body, "logprobs", 0, MAX_LOGPROBS)
    min_tokens = _count(body, "min_tokens", 0, 2**31 - 1) or 0
    prompt_logprobs = _prompt_logprobs(body)
    if prompt_logprobs is None and get_field(body, "echo", bool, False):
        # vLLM's to_sampling_params: echo asks for the prompt's logprobs, completions'
        # with its `logprobs` (none without), chat's with `top_logprobs` (0 unset).
        prompt_logprobs = top if chat else logprobs
    return {"n": n or 1, "best_of": best_of, "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
            "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
            "repetition_penalty": _repetition_penalty(body),
            "logit_bias": _logit_bias(body), "min_tokens": min_tokens}


def sampling_from_body(body: dict[str, Any], max_tokens_keys: tuple[str, ...],
                       chat: bool = False, defaults: GenerationDefaults | None = None,
                       ) -> tuple[SamplingParams, bool]:
    """Returns (params, max_tokens_given). Checks types and ranges (not the context).
    `defaults`: the model's generation config (gateway/generation_config.py), for the
    fields the body leaves unset; its extra EOS ids become stop tokens."""
    max_tokens = None
    for key in max_tokens_keys:
        max_tokens = get_field(body, key, int, None)
        if max_tokens is not None:
            if max_tokens <= 0:
                raise InvalidRequest(f"`{key}` must be at least 1, got {max_tokens}", key)
            break
    top_k = get_field(body, "top_k", int, None)
    if top_k is not None and top_k < -1:
        raise InvalidRequest(f"`top_k` must be -1 (disable) or at least 0, got {top_k}", "top_k")
    stop_ids = get_field(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise InvalidRequest("`stop_token_ids` must be a list of integers", "stop_token_ids")
    ignore_eos = get_field(body, "ignore_eos", bool, False)
    allowed = get_field(body, "allowed_token_ids", list, None)
    if allowed is not None and not all(isinstance(t, int) and not isinstance(t, bool)
                                       for t in allowed):
        raise InvalidRequest("`allowed_token_ids` must be a list of integers",
                             "allowed_token_ids")
    bad_words = get_field(body, "bad_words", list, None) or []
    if not all(isinstance(w, str) for w in bad_words):
        raise InvalidRequest("`bad_words` must be a list of strings", "bad_words")
    # Accepted no-ops (gateway/params.py), still typed as vLLM types them.
    get_field(body, "length_penalty", (int, float), 1.0)
    get_field(body, "spaces_between_special_tokens", bool, True)
    params = SamplingParams(
        max_tokens=max_tokens or 1,  # placeholder until the prompt length is known
        temperature=float(get_field(body, "temperature", (int, float), 1.0)),
        top_p=float(get_field(body, "top_p", (int, float), 1.0)),
        top_k=None if top_k in (None, -1, 0) else top_k,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        include_stop_str_in_output=get_field(body, "include_stop_str_in_output", bool, False),
        seed=_count(body, "seed", -2**63, 2**63 - 1),  # any int64, as vLLM
        stop=_stop(body), stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        skip_special_tokens=get_field(body, "skip_special_tokens", bool, True),
        allowed_token_ids=allowed, bad_words=bad_words,
        **_classic(body, chat))
    if params.min_tokens and max_tokens is not None and params.min_tokens > max_tokens:
        raise InvalidRequest(f"`min_tokens` ({params.min_tokens}) must not exceed max_tokens "
                             f"({max_tokens})", "min_tokens")
    if not 0.0 <= params.temperature <= 2.0:
        raise InvalidRequest(f"`temperature` must be in [0, 2], got {params.temperature}",
                             "temperature")
    if defaults is not None:
        defaults.apply(params, [k for k in SAMPLING_FIELDS if body.get(k) is None])
    return params, max_tokens is not None
