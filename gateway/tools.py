"""Tools on chat completions: validate `tools` / `tool_choice` / `parallel_tool_calls`,
force a call through structured outputs where the request demands one, and turn a
choice's output text into `content` + `tool_calls`, streamed or whole, in vLLM's shapes.

How a call comes to be, by `tool_choice` (vLLM's approach):
- "auto" (the default with tools): the model decides; the model family's parser
  (gateway/tool_parsers.py, chosen per model) finds calls in its text.
- "required": a JSON schema for a non-empty array of `{"name", "parameters"}` objects,
  one alternative per tool, constrains the output (xgrammar); the array is the calls.
- a named function: that function's parameters schema constrains the output, which is
  the call's arguments.
- "none": plain text (the tools still reach the chat template).
"""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import StructuredOutput
from gateway.errors import InvalidRequest
from gateway.tool_parsers import PARSERS, Parsed, parse_required

TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A request's validated tools. `mode`: none | auto | required | named (`name`)."""

    tools: tuple[dict[str, Any], ...]
    mode: str
    name: str | None = None
    parallel: bool = True
    parser: str | None = None  # the model's tool-call format (mode auto)

    def function(self, name: str) -> dict[str, Any]:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def _tool(t: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function" \
            or not isinstance(t.get("function"), dict):
        raise InvalidRequest(f"`{where}` must be {{\"type\": \"function\", \"function\": "
                             "{...}}", "tools")
    fn = t["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidRequest(f"`{where}.function.name` must be a non-empty string", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidRequest(f"`{where}.function.parameters` must be a JSON Schema object",
                             "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise InvalidRequest(f"`{where}.function.description` must be a string", "tools")
    return {"type": "function", "function": fn}


def parse_tools(tools: Any, tool_choice: Any, parallel: Any) -> ToolChoice | None:
    """The request's tools (None without any). 400s with vLLM's messages."""
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("`tools` must be a list of function tools", "tools")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("`parallel_tool_calls` must be a boolean", "parallel_tool_calls")
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return None
    checked = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    par = parallel is not False
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return ToolChoice(checked, tool_choice or "auto", parallel=par)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict) \
            and isinstance(tool_choice["function"].get("name"), str):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise InvalidRequest("The tool specified in `tool_choice` does not match any of "
                                 "the specified `tools`", "tool_choice")
        return ToolChoice(checked, "named", name=name, parallel=par)
    raise InvalidRequest(f"Invalid value for `tool_choice`: {tool_choice!r}! Only named tools, "
                         '"none", "auto" or "required" are supported.', "tool_choice")


def tools_from_json(tools_json: str, tool_choice_json: str) -> ToolChoice | None:
    """The gRPC spelling: `tools` and `tool_choice` as JSON text (empty: unset)."""
    try:
        tools = json.loads(tools_json) if tools_json else None
        choice = json.loads(tool_choice_json) if tool_choice_json else None
    except ValueError as e:
        raise InvalidRequest(f"tools_json / tool_choice_json is not valid JSON: {e}",
                             "tools_json") from e
    return parse_tools(tools, choice, None)


def forced_structure(tc: ToolChoice | None) -> tuple[str, StructuredOutput] | None:
    """The constraint `tool_choice` imposes (required / named), with its source."""
    if tc is None or tc.mode not in ("required", "named"):
        return None
    if tc.mode == "named":
        assert tc.name is not None
        params = tc.function(tc.name).get("parameters") or EMPTY_PARAMETERS
        return "tool_choice", StructuredOutput("json_schema", json.dumps(params,
                                                                         ensure_ascii=False))
    defs: dict[str, Any] = {}
    alternatives = []
    for t in tc.tools:
        params = copy.deepcopy(t["function"].get("parameters")) or dict(EMPTY_PARAMETERS)
        for name, sub in params.pop("$defs", {}).items():  # refs are to the root
            if defs.setdefault(name, sub) != sub:
                raise InvalidRequest(f"Tool definition '{name}' has multiple schemas, which "
                                     "is not supported.", "tools")
        alternatives.append({
            "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                           "parameters": params},
            "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": alternatives}}
    if not tc.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return "tool_choice", StructuredOutput("json_schema", json.dumps(schema, ensure_ascii=False))


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or new_tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass(slots=True)
class _Streamed:
    id: str
    args_sent: int = 0


@dataclass(slots=True)
class ChatOutput:
    """One choice's output as a chat message with tools. Streaming: `stream` each text
    delta (and the engine's finish reason on the last); whole: `message`. The same
    parse serves both; only a stream sends arguments as the model wrote them (vLLM's
    stream does; its whole response re-serializes them)."""

    tools: ToolChoice
    text: str = ""
    _content_sent: int = 0
    _calls: list[_Streamed] = field(default_factory=list)

    @property
    def mode(self) -> str:
        """text (no call can happen) | auto | required | named."""
        tc = self.tools
        if tc.mode == "none" or (tc.mode == "auto" and tc.parser is None):
            return "text"
        return tc.mode

    def _parse(self, text: str, final: bool) -> Parsed:
        if self.mode == "required":
            return parse_required(text, final)
        assert self.tools.parser is not None
        return PARSERS[self.tools.parser](text, final)

    # -- streaming -----------------------------------------------------------------
    def stream(self, delta: str, finish: str | None,
               ) -> tuple[dict[str, Any] | None, str | None]:
        """(the chunk's `delta` object, or None when there is nothing to send yet; the
        finish reason to send: "tool_calls" once calls went out, as vLLM)."""
        self.text += delta
        mode = self.mode
        if mode == "text":
            out: list[dict[str, Any]] = [{"content": delta}] if delta else []
        elif mode == "named":
            out = self._named(delta)
        else:
            out = self._diff(self._parse(self.text, final=finish is not None))
            if finish is not None and not self._calls and len(self.text) > self._content_sent:
                # No call after all: the rest is content, as the whole response has it.
                out.append({"content": self.text[self._content_sent:]})
                self._content_sent = len(self.text)
        merged: dict[str, Any] = {}
        for d in out:
            if "content" in d:
                merged["content"] = merged.get("content", "") + d["content"]
            merged.setdefault("tool_calls", []).extend(d.get("tool_calls", []))
        if not merged.get("tool_calls"):
            merged.pop("tool_calls", None)
        if finish is not None and self._calls:
            finish = "tool_calls"
        return (merged or None), finish

    def _named(self, delta: str) -> list[dict[str, Any]]:
        """The forced call: all the text is its arguments."""
        if self._calls:
            return [_args_delta(0, delta)] if delta else []
        self._calls.append(_Streamed(new_tool_call_id()))
        return [{"tool_calls": [{"id": self._calls[0].id, "type": "function", "index": 0,
                                 "function": {"name": self.tools.name, "arguments": delta}}]}]

    def _diff(self, p: Parsed) -> list[dict[str, Any]]:
        """What `p` shows beyond what was sent: content, new calls, argument text."""
        out: list[dict[str, Any]] = []
        if p.decided and not self._calls and len(p.content) > self._content_sent:
            out.append({"content": p.content[self._content_sent:]})
            self._content_sent = len(p.content)
        for i, call in enumerate(p.calls[:None if self.tools.parallel else 1]):
            if call.name is None:
                break  # calls stream in order, each from its name on
            delta: dict[str, Any] = {}
            if i == len(self._calls):
                self._calls.append(_Streamed(new_tool_call_id()))
                delta = {"id": self._calls[i].id, "type": "function", "index": i,
                         "function": {"name": call.name}}
            sent = self._calls[i]
            args = call.args or ""
            if len(args) > sent.args_sent:
                if delta:
                    delta["function"]["arguments"] = args[sent.args_sent:]
                else:
                    delta = _args_delta(i, args[sent.args_sent:])["tool_calls"][0]
                sent.args_sent = len(args)
            if delta:
                out.append({"tool_calls": [delta]})
        return out

    # -- whole ---------------------------------------------------------------------------
    def message(self, text: str, finish: str | None,
                ) -> tuple[str | None, list[dict[str, Any]], str | None]:
        """(content, tool_calls, finish reason) of the finished output `text`, as vLLM's
        non-streamed response: without a valid call all of the text is content; the
        reason is "tool_calls" when the model called (auto) or had to (required)."""
        mode = self.mode
        if mode == "text":
            return text, [], finish
        if mode == "named":
            assert self.tools.name is not None
            return "", [tool_call(self.tools.name, text)], finish
        p = self._parse(text, final=True)
        calls = _complete(p)[:None if self.tools.parallel else 1]
        if not calls:
            return text, [], finish
        made = [tool_call(name, args) for name, args in calls]
        return ("" if mode == "required" else p.content or None), made, "tool_calls"


def _args_delta(index: int, text: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def _complete(p: Parsed) -> list[tuple[str, str]]:
    """(name, arguments normalized as vLLM's json.dumps) of every call, or [] when one
    is unfinished or not JSON."""
    if p.broken:
        return []
    out = []
    for c in p.calls:
        if not c.closed or c.name is None:
            return []
        try:
            args = json.loads(c.args) if c.args is not None else {}
        except ValueError:
            return []
        out.append((c.name, json.dumps(args, ensure_ascii=False)))
    return out


def message_tool_fields(m: dict[str, Any], i: int) -> dict[str, Any]:
    """A chat message's tool fields as chat templates take them: an assistant's
    `tool_calls` with their arguments parsed to objects (as transformers and vLLM hand
    them over), a tool result's `tool_call_id`, and `name`."""
    out: dict[str, Any] = {}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if m["role"] == "tool" and m.get("tool_call_id") is not None:
        if not isinstance(m["tool_call_id"], str):
            raise InvalidRequest(f"messages[{i}].tool_call_id must be a string", "messages")
        out["tool_call_id"] = m["tool_call_id"]
    calls = m.get("tool_calls")
    if calls is None or m["role"] != "assistant":
        return out
    if not isinstance(calls, list):
        raise InvalidRequest(f"messages[{i}].tool_calls must be a list", "messages")
    out["tool_calls"] = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", "{}"), str):
            raise InvalidRequest(f"messages[{i}].tool_calls[{j}] must be {{\"id\", \"type\": "
                                 "\"function\", \"function\": {\"name\", \"arguments\"}}",
                                 "messages")
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError as e:
            raise InvalidRequest(f"messages[{i}].tool_calls[{j}].function.arguments is not "
                                 f"valid JSON: {e}", "messages") from e
        out["tool_calls"].append({"id": c.get("id") or new_tool_call_id(), "type": "function",
                                  "function": {"name": fn["name"], "arguments": args}})
    return out
