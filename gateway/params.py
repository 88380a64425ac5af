"""Which request fields the OpenAI front implements, refuses or has never heard of.

No silent ignoring: a field of the OpenAI API reference (completions, chat completions)
or one of vLLM's extra parameters that splitserve does not implement gets a 400 naming
it, when its value asks for something (a default value is harmless and accepted).
Fields nobody defines are ignored with a log line, as vLLM does.

`REFUSED[field]` says when a value asks for what we do not do; `IMPLEMENTED` lists the
fields some part of the gateway reads (gateway/protocol.py, sampling.py, structured outputs, tools,
identity).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from gateway.errors import InvalidRequest

log = logging.getLogger(__name__)


def _given(v: Any) -> bool:
    return v is not None


def _truthy(v: Any) -> bool:
    return bool(v)


def _not(*defaults: Any) -> Callable[[Any], bool]:
    return lambda v: v is not None and v not in defaults


# Both endpoints: vLLM's sampling extras we do not implement.
_SAMPLING: dict[str, Callable[[Any], bool]] = {
    "use_beam_search": _truthy,
    "logits_processors": _given,
    "kv_transfer_params": _given, "vllm_xargs": _given,
    "prompt_embeds": _given,
    # vLLM's stop on repeated token patterns.
    "max_repetition_pattern_size": _not(0), "min_repetition_pattern_size": _not(0),
    "repetition_min_count": _not(0),
}

REFUSED: dict[str, dict[str, Callable[[Any], bool]]] = {
    "completions": _SAMPLING | {"suffix": _given},
    "chat": _SAMPLING | {
        "audio": _given, "prediction": _given, "reasoning_effort": _given,
        "verbosity": _given, "web_search_options": _given, "store": _truthy,
        "modalities": lambda v: v is not None and list(v) != ["text"],
        "service_tier": _not("auto", "default"),
        # The deprecated forms of `tools` / `tool_choice`.
        "functions": _given, "function_call": _given,
        # vLLM's chat extras.
        "documents": _given,
        "chat_template": _given,
        "mm_processor_kwargs": _given,
    },
}

_COMMON = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "n",
    "seed", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "logprobs",
    "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
    "user", "priority", "cache_salt", "metadata", "min_p", "include_stop_str_in_output",
    "return_token_ids", "truncate_prompt_tokens", "return_tokens_as_token_ids",
    "allowed_token_ids", "bad_words", "prompt_logprobs",
    "request_id",  # the request's id when no x-request-id header names one (gateway/http_server.py)
    # No-ops in vLLM for us, accepted as it accepts them: length_penalty only weighs
    # beam search (refused above); spaces_between_special_tokens only reaches vLLM's
    # slow-tokenizer detokenizer, and ours is a fast (`tokenizers`) one.
    "length_penalty", "spaces_between_special_tokens",
    # structured outputs and tools (their own modules read them)
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_json_object", "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structural_tag",
}
IMPLEMENTED: dict[str, set[str]] = {
    "completions": _COMMON | {"prompt", "echo", "best_of", "add_special_tokens"},
    "chat": _COMMON | {"messages", "top_logprobs", "max_completion_tokens",
                       "add_generation_prompt", "tools", "tool_choice", "parallel_tool_calls",
                       "safety_identifier", "prompt_cache_key", "include_reasoning",
                       "chat_template_kwargs", "continue_final_message",
                       "add_special_tokens", "echo"},
}


def check_fields(body: dict[str, Any], endpoint: str) -> None:
    """Raises InvalidRequest naming the first field we do not implement that asks for
    something; logs the fields nobody defines (then ignored)."""
    refused = REFUSED[endpoint]
    for name, value in body.items():
        if name in refused and refused[name](value):
            raise InvalidRequest(f"`{name}` is not supported by this server", name)
    unknown = sorted(set(body) - IMPLEMENTED[endpoint] - set(refused))
    if unknown:
        log.warning("The following fields were present in the request but ignored: %s",
                    set(unknown))
