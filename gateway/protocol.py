"""OpenAI request bodies -> validated `GenerateInput` (token ids + SamplingParams).

Everything here runs before any routing: a bad request never reaches a worker. Parameters
we do not implement are refused and unknown fields logged and ignored (gateway/params.py).
Errors are InvalidRequest (400) or ModelNotFound (404) with vLLM's messages where vLLM has
one. `ModelContext` owns the tokenizer and the model's limits. The body's JSON and typed
field reads are gateway/body.py's; its sampling fields gateway/sampling.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from engine.config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer, bad_word_ids
from gateway.body import body_object, get_field
from gateway.errors import InvalidRequest, ModelNotFound
from gateway.generation_config import load_generation_defaults
from gateway.params import check_fields
from gateway.sampling import sampling_from_body
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
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs name "token_id:N"
    cache_salt: str | None = None
    priority: int = 0
    tenant: str = ""  # set by the front from the request's identity (gateway/identity.py)
    labels: dict[str, str] = field(default_factory=dict)
    # /v1/completions `echo`: the prompt (its text; with logprobs, its tokens' logprobs)
    # comes first; `echo_only` (max_tokens 0): the prompt alone, nothing generated shown.
    echo: bool = False
    echo_only: bool = False
    prompt_text: str = ""
    # chat `echo`: the last message's content, shown before the reply (vLLM's rule).
    chat_echo: str = ""
    tools: ToolChoice | None = None  # chat: how to read tool calls out of the output
    # Where the first token's time went, in seconds (gateway/core.py fills it):
    # queue, route, worker_queue, prefill, kv_transfer, total.
    ttft: dict[str, float] = field(default_factory=dict)


T = TypeVar("T")


class ModelContext:
    """The served model as the gateway knows it (torch-free), and the threads the fronts
    parse requests on (`off_loop`)."""

    def __init__(self, model_dir: str, served_name: str, max_model_len: int | None = None,
                 tool_call_parser: str = "auto", parse_threads: int = 4,
                 generation_config: str = "auto") -> None:
        """`tool_call_parser`: the format tool calls take in this model's output (a
        name in gateway/tool_parsers.PARSERS), "auto" (from the chat template) or
        "none" (tool_choice "auto" refused). `parse_threads`: requests parsed at once;
        more wait their turn. `generation_config`: vLLM's --generation-config (auto,
        vllm or a directory; gateway/generation_config.py)."""
        # Created now, its threads only when first used; close() ends them.
        self._parse_pool = ThreadPoolExecutor(parse_threads, thread_name_prefix="gw-parse")
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
        eos = self.tokenizer.eos_token_id
        self.defaults = load_generation_defaults(generation_config, model_dir,
                                                 () if eos is None else (eos,))

    def observe_worker_limit(self, max_model_len: int) -> None:
        """A worker serves at most `max_model_len` tokens (its --max-model-len): the
        gateway validates against the smallest limit seen, so a request it accepts fits
        every worker. Only ever lowers the limit."""
        if 0 < max_model_len < self.max_model_len:
            self.max_model_len = max_model_len

    async def off_loop(self, parse: Callable[..., T], *args: Any) -> T:
        """`parse(*args)` on the parsing threads, not the event loop: tokenizing a prompt
        at the body limit, or rendering a chat template, takes seconds, during which the
        loop keeps serving other requests (the tokenizer releases the GIL). The parse
        itself is unchanged: its checks still come before its tokenization."""
        return await asyncio.get_running_loop().run_in_executor(self._parse_pool, parse, *args)

    def close(self) -> None:
        self._parse_pool.shutdown(wait=False, cancel_futures=True)

    def check_model(self, model: Any) -> str:
        if model is None or model == "":
            return self.served_name
        if model != self.served_name:
            raise ModelNotFound(f"The model `{model}` does not exist.", "model")
        return self.served_name


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
COMPLETION_MAX_TOKENS = 16  # vLLM's /v1/completions default


def truncate_prompt(body: dict[str, Any], ctx: ModelContext, ids: list[int],
                    text: str | None = None) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: keep the prompt's last k tokens (-1: the context
    length). `text`: the prompt `ids` encode with the tokenizer's special tokens, which
    stay, as in the tokenizer call vLLM truncates with (transformers' left truncation:
    the text's last tokens fill what they leave)."""
    k = get_field(body, "truncate_prompt_tokens", int, None)
    if k is None:
        return ids
    if k == -1:
        k = ctx.max_model_len
    if k < 1:
        raise InvalidRequest(f"`truncate_prompt_tokens` must be -1 or at least 1, got {k}",
                             "truncate_prompt_tokens")
    if k > ctx.max_model_len:
        raise InvalidRequest(f"truncate_prompt_tokens value ({k}) is greater than "
                             f"max_model_len ({ctx.max_model_len}). Please, select a smaller "
                             "truncation size.", "truncate_prompt_tokens")
    if len(ids) <= k:
        return ids
    if text is not None:
        content = ctx.tokenizer.encode(text, add_special_tokens=False)
        added = len(ids) - len(content)  # the tokenizer's own, around the text's
        at = next((s for s in range(added + 1) if ids[s:s + len(content)] == content), None)
        if at is not None and 0 < k - added:
            keep = k - added
            return ids[:at] + content[len(content) - keep:] + ids[at + len(content):]
    return ids[-k:]


def finish_input(ctx: ModelContext, model: str, ids: list[int], params: SamplingParams,
                 max_tokens_given: bool, default_max: int | None = None,
                 **kw: Any) -> GenerateInput:
    """Context-length and vocabulary checks once the prompt is tokenized, as vLLM's
    serving_engine._validate_input. Without max_tokens: `default_max` (completions'
    16, which must fit), else the rest of the context (chat: the prompt must leave
    one token); the model's generation config (max_new_tokens) caps either after the
    check, as vLLM's get_max_tokens."""
    if not ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    if any(not 0 <= t < ctx.vocab_size for t in ids):
        raise InvalidRequest(f"the prompt holds token ids outside [0, {ctx.vocab_size})",
                             "prompt")
    limit = ctx.max_model_len
    if not max_tokens_given:
        if default_max is None and len(ids) >= limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {len(ids)} input tokens. Please reduce the length of the "
                "input messages.", "prompt")
        params.max_tokens = default_max or limit - len(ids)
    total = len(ids) + params.max_tokens
    if total > limit:
        raise InvalidRequest(
            f"This model's maximum context length is {limit} tokens. However, "
            f"you requested {total} tokens ({len(ids)} in the messages, {params.max_tokens} "
            f"in the completion). Please reduce the length of the messages or completion.",
            "max_tokens" if max_tokens_given else "prompt")
    cap = ctx.defaults.sampling.get("max_tokens")
    if cap is not None:
        params.max_tokens = max(1, min(params.max_tokens, int(cap)))
    try:
        params.validate(ctx.vocab_size)
        bad_word_ids(ctx.tokenizer, params.bad_words, ctx.vocab_size)
    except ValueError as e:
        raise InvalidRequest(str(e)) from e
    return GenerateInput(model=model, prompt_token_ids=ids, params=params, **kw)


def _stream_flags(body: dict[str, Any]) -> dict[str, Any]:
    stream = get_field(body, "stream", bool, False)
    opts = get_field(body, "stream_options", dict, None)
    if opts is not None and not stream:
        raise InvalidRequest("Stream options can only be defined when `stream=True`.",
                             "stream_options")
    include_usage = bool(opts and get_field(opts, "include_usage", bool, False))
    # vLLM: continuous usage only together with include_usage.
    continuous = include_usage and bool(
        opts and get_field(opts, "continuous_usage_stats", bool, False))
    salt = get_field(body, "cache_salt", str, None)
    if salt == "":
        raise InvalidRequest("`cache_salt` must be a non-empty string", "cache_salt")
    return {"stream": stream, "include_usage": include_usage, "continuous_usage": continuous,
            "cache_salt": salt, "priority": get_field(body, "priority", int, 0),
            "return_token_ids": get_field(body, "return_token_ids", bool, False),
            "tokens_as_ids": get_field(body, "return_tokens_as_token_ids", bool, False)}


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
    body = body_object(body)
    model = ctx.check_model(body.get("model"))
    check_fields(body, "completions")
    prompts = _prompts(body)
    echo = get_field(body, "echo", bool, False)
    echo_only = echo and body.get("max_tokens") == 0
    if echo_only:  # vLLM: the prompt alone (one token is generated and not shown)
        body = body | {"max_tokens": 1}
    params, given = sampling_from_body(body, ("max_tokens",), defaults=ctx.defaults)
    params.structured = structured_from_body(body)
    special = get_field(body, "add_special_tokens", bool, True)
    flags = _stream_flags(body)
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids, text = ctx.tokenizer.encode(prompt, add_special_tokens=special), prompt
            ids = truncate_prompt(body, ctx, ids, prompt if special else None)
        else:
            ids, text = list(prompt), ctx.tokenizer.decode(prompt, skip_special_tokens=False) \
                if echo else ""
            ids = truncate_prompt(body, ctx, ids)
        # vLLM's default is 16 when the field is absent; an explicit null leaves it None:
        # the rest of the context.
        default = None if "max_tokens" in body and body["max_tokens"] is None \
            else COMPLETION_MAX_TOKENS
        out.append(finish_input(ctx, model, ids, replace(params), given, default, echo=echo,
                                echo_only=echo_only, prompt_text=text, **flags))
    return out


def message_text(m: Any, i: int) -> dict[str, Any]:
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
    body = body_object(body)
    model = ctx.check_model(body.get("model"))
    check_fields(body, "chat")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequest("`messages` must be a non-empty list", "messages")
    messages = [message_text(m, i) for i, m in enumerate(msgs)]
    tools = chat_tools(ctx, parse_tools(body.get("tools"), body.get("tool_choice"),
                                        body.get("parallel_tool_calls")))
    ids = truncate_prompt(body, ctx, chat_prompt(body, ctx, messages, tools))
    params, given = sampling_from_body(body, ("max_completion_tokens", "max_tokens"),
                                       chat=True, defaults=ctx.defaults)
    params.structured = structured_from_body(body, forced_structure(tools))
    return finish_input(ctx, model, ids, params, given, tools=tools,
                        chat_echo=_chat_echo(body, messages), **_stream_flags(body))


def _chat_echo(body: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    """vLLM's chat `echo`: the last message's content when its role is the reply's (the
    assistant's with add_generation_prompt, else the last message's own), else ""."""
    if not get_field(body, "echo", bool, False):
        return ""
    role = "assistant" if get_field(body, "add_generation_prompt", bool, True) \
        else messages[-1]["role"]
    return str(messages[-1]["content"] or "") if messages[-1]["role"] == role else ""


def chat_prompt(body: dict[str, Any], ctx: ModelContext, messages: list[dict[str, Any]],
                tools: ToolChoice | None) -> list[int]:
    """The conversation through the chat template, with vLLM's add_generation_prompt,
    continue_final_message (the last assistant message left open, for the model to go
    on with), add_special_tokens (default false: the template places them) and
    chat_template_kwargs."""
    add_prompt = get_field(body, "add_generation_prompt", bool, True)
    cont = get_field(body, "continue_final_message", bool, False)
    if cont and add_prompt:
        raise InvalidRequest("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.", "continue_final_message")
    if cont and messages[-1]["role"] != "assistant":
        raise InvalidRequest("`continue_final_message` needs the last message to be the "
                             "assistant's", "continue_final_message")
    try:
        text = ctx.tokenizer.apply_chat_template(
            messages, add_prompt, list(tools.tools) if tools else None, template_kwargs(body))
    except ValueError as e:
        raise InvalidRequest(str(e), "messages") from e
    if cont:  # as transformers: cut after the final message's content
        final = messages[-1]["content"].strip()
        at = text.rfind(final) if final else -1
        if at < 0:
            raise InvalidRequest("the chat template does not render the final message's "
                                 "content; it cannot be continued", "continue_final_message")
        text = text[:at + len(final)]
    return ctx.tokenizer.encode(text, add_special_tokens=get_field(
        body, "add_special_tokens", bool, False))


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs`: extra variables for the chat template (Qwen3's
    `enable_thinking`, ...); they override the template's other inputs but `messages`."""
    kw = get_field(body, "chat_template_kwargs", dict, None) or {}
    if "messages" in kw:
        raise InvalidRequest("`chat_template_kwargs` cannot set `messages`",
                             "chat_template_kwargs")
    return dict(kw)


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
    body = body_object(body)
    ctx.check_model(body.get("model"))
    if "messages" in body:
        msgs = body["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise InvalidRequest("`messages` must be a non-empty list", "messages")
        try:
            return ctx.tokenizer.encode_chat(
                [message_text(m, i) for i, m in enumerate(msgs)],
                add_generation_prompt=get_field(body, "add_generation_prompt", bool, True))
        except ValueError as e:
            raise InvalidRequest(str(e), "messages") from e
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequest("give `prompt` (a string) or `messages`", "prompt")
    return ctx.tokenizer.encode(prompt, get_field(body, "add_special_tokens", bool, True))


def parse_detokenize(body: Any, ctx: ModelContext) -> list[int]:
    body = body_object(body)
    ctx.check_model(body.get("model"))
    ids = body.get("tokens")
    # Checked by C loops (600k ids ~25 ms): `type(t) is int` refuses bools and floats.
    if not isinstance(ids, list) or not set(map(type, ids)) <= {int}:
        raise InvalidRequest("`tokens` must be a list of token ids", "tokens")
    if ids and (min(ids) < 0 or max(ids) >= ctx.vocab_size):
        raise InvalidRequest(f"`tokens` holds ids outside [0, {ctx.vocab_size})", "tokens")
    return ids
