"""Tool calls in model output text: where they are, their names and raw arguments.

A parser reads the whole output so far and returns a `Parsed`: the content text that
is certainly not part of a call, and each call seen (its name once complete, its
arguments' raw JSON text so far, whether the call's object is closed). Streaming
re-parses the growing text on every delta and sends what changed (gateway/tools.py):
outputs are short, and a parse from the start has no state to get wrong.

Formats (vLLM's parsers of the same names):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated; the
  content is the text before the first call (Hermes, Qwen 2.5/3 and most chat models
  trained on the Hermes format).
- `llama3_json`: the whole output is `{"name": ..., "parameters": {...}}` calls
  separated by `;`, optionally after `<|python_tag|>`; otherwise it is all content
  (Llama 3.1-3.3 JSON tool calling).
- `required` (internal): a JSON array of `{"name", "parameters"}` objects, what
  `tool_choice: "required"` forces through structured outputs (as vLLM does).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

ARG_KEYS = ("arguments", "parameters")


@dataclass(slots=True)
class CallScan:
    """One call object: `name` once its string is complete; `args` the raw text of its
    arguments value so far (None before it starts); `closed` once the object is."""

    name: str | None = None
    args: str | None = None
    args_done: bool = False
    closed: bool = False
    end: int = 0  # characters of the scanned text the object took (when closed)
    broken: bool = False  # not a JSON object


@dataclass(slots=True)
class Parsed:
    content: str = ""
    calls: list[CallScan] = field(default_factory=list)
    # False: the text so far may still turn out to be calls (hold its content back).
    decided: bool = True
    broken: bool = False  # a call that is not valid JSON


def scan_call(text: str) -> CallScan:
    """Scans the JSON object at the start of `text` (leading whitespace allowed),
    tolerating an unfinished end: the top-level "name" string and the raw text of the
    "arguments" / "parameters" value."""
    out = CallScan()
    depth, in_str, esc = 0, False, False
    phase = "start"  # start | key | colon | value | after (at depth 1)
    key: str | None = None
    tok = val = -1  # where the current key string / value starts

    def value_end(j: int) -> None:
        nonlocal phase, val
        raw = text[val:j].strip()
        if key == "name":
            try:
                name = json.loads(raw)
            except ValueError:
                name = None
            out.name = name if isinstance(name, str) else None
        elif key in ARG_KEYS:
            out.args, out.args_done = raw, True
        phase, val = "after", -1

    for i, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 1 and phase == "key":
                    try:
                        key = json.loads(text[tok:i + 1])
                    except ValueError:
                        key = None
                    phase = "colon"
                elif depth == 1 and phase == "value":
                    value_end(i + 1)
            continue
        if phase == "start":
            if c == "{":
                depth, phase = 1, "key"
            elif not c.isspace():
                out.broken = True
                return out
            continue
        if c == '"':
            in_str = True
            if depth == 1:
                if phase == "value" and val < 0:
                    val = i
                else:
                    tok = i
            continue
        if c in "{[":
            if depth == 1 and phase == "value" and val < 0:
                val = i
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 1 and phase == "value":
                value_end(i + 1)
            elif depth == 0:
                if phase == "value" and val >= 0:  # a number / literal ends the object
                    value_end(i)
                out.closed, out.end = True, i + 1
                break
        elif depth == 1:
            if c == ":" and phase == "colon":
                phase, val = "value", -1
            elif c == ",":
                if phase == "value" and val >= 0:
                    value_end(i)
                phase = "key"
            elif phase == "value" and val < 0 and not c.isspace():
                val = i  # a number or literal
    if phase == "value" and val >= 0 and key in ARG_KEYS and not out.args_done:
        out.args = text[val:].rstrip()
    return out


def _partial_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that begins `marker` (held back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _calls(text: str, pos: int, sep: str, close: str = "",
           ) -> tuple[list[CallScan], bool, int]:
    """Call objects from `pos`, separated by `sep`, until `close`, the end or garbage.
    Returns (calls, broken, where the scan stopped)."""
    calls: list[CallScan] = []
    while True:
        pos = _skip_ws(text, pos)
        if pos >= len(text) or (close and text.startswith(close, pos)):
            return calls, False, pos
        scan = scan_call(text[pos:])
        if scan.broken:
            return calls, True, pos
        calls.append(scan)
        if not scan.closed:
            return calls, False, len(text)
        pos = _skip_ws(text, pos + scan.end)
        if pos < len(text) and text[pos] == sep:
            pos += 1
        elif pos < len(text) and not (close and text.startswith(close, pos)):
            return calls, True, pos


HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, final: bool) -> Parsed:
    first = text.find(HERMES_START)
    if first < 0:
        hold = 0 if final else _partial_prefix(text, HERMES_START)
        return Parsed(content=text[:len(text) - hold])
    out = Parsed(content=text[:first])
    pos = first
    while pos >= 0:  # one object per <tool_call> ... </tool_call>
        calls, broken, pos = _calls(text, pos + len(HERMES_START), sep="", close=HERMES_END)
        out.calls += calls
        if broken or len(calls) != 1 or not calls[0].closed:
            out.broken = broken or len(calls) > 1
            break
        pos = text.find(HERMES_START, pos)
    return out


PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, final: bool) -> Parsed:
    start = _skip_ws(text, 0)
    rest = text[start:]
    if not final and (not rest or PYTHON_TAG.startswith(rest)):
        return Parsed(decided=False)
    if rest.startswith(PYTHON_TAG):
        start += len(PYTHON_TAG)
    elif not rest.startswith("{"):
        return Parsed(content=text)
    calls, broken, _ = _calls(text, start, sep=";")
    return Parsed(calls=calls, broken=broken)


def parse_required(text: str, final: bool) -> Parsed:
    start = _skip_ws(text, 0)
    if start >= len(text):
        return Parsed(decided=final)
    if text[start] != "[":
        return Parsed(broken=True)
    calls, broken, _ = _calls(text, start + 1, sep=",", close="]")
    return Parsed(calls=calls, broken=broken)


Parser = Callable[[str, bool], Parsed]
PARSERS: dict[str, Parser] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def default_parser(chat_template: str | None) -> str | None:
    """The parser a model's chat template implies: Hermes tags, else Llama 3 JSON."""
    if not chat_template:
        return None
    if HERMES_START in chat_template:
        return "hermes"
    if PYTHON_TAG in chat_template or (
            "<|start_header_id|>" in chat_template and "tools" in chat_template):
        return "llama3_json"
    return None
