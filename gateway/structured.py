"""Structured-output request fields -> one `StructuredOutput` (or none).

Three spellings reach the same constraint, as in vLLM:
- OpenAI's `response_format`: {"type": "text" | "json_object" | "json_schema",
  "json_schema": {"name", "schema", "strict"}};
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object"};
- vLLM's older extras `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
  `guided_json_object` (and `guided_decoding_backend`, which may only name xgrammar).
At most one constraint per request: two (from any spellings) are a 400, as vLLM's
"You can only use one kind of structured outputs constraint". Whether the schema,
regex or grammar compiles is the worker's call (xgrammar's message comes back as 400).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from engine.sampling_params import StructuredOutput
from gateway.errors import InvalidRequest

# Request keys read here (the unsupported-parameter check treats them as known).
STRUCTURED_KEYS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                   "guided_choice", "guided_grammar", "guided_json_object",
                   "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag")
_SO_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
# structured_outputs options we accept: xgrammar is the only backend, so there is no
# fallback to disable; disable_any_whitespace fixes JSON's layout, as xgrammar does in vLLM.
_SO_OPTIONS = ("disable_fallback", "disable_any_whitespace")


def _schema_text(value: Any, where: str) -> str:
    """A JSON Schema given as an object or as JSON text -> its serialized form."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequest(f"`{where}` is not valid JSON: {e}", where) from e
    if not isinstance(value, dict | bool):
        raise InvalidRequest(f"`{where}` must be a JSON Schema object", where)
    return json.dumps(value, ensure_ascii=False)


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"`{where}` must be a non-empty string", where)
    return value


def _choices(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value \
            or not all(isinstance(c, str) and c for c in value):
        raise InvalidRequest(f"`{where}` must be a non-empty list of non-empty strings", where)
    return tuple(value)


def _one(field: str, value: Any, where: str) -> StructuredOutput | None:
    """One constraint field (vLLM's names) -> its StructuredOutput; None for a false
    json_object."""
    if field == "json":
        return StructuredOutput("json_schema", _schema_text(value, where))
    if field == "regex":
        return StructuredOutput("regex", _string(value, where))
    if field == "choice":
        return StructuredOutput("choice", choices=_choices(value, where))
    if field == "grammar":
        return StructuredOutput("grammar", _string(value, where))
    if not isinstance(value, bool):
        raise InvalidRequest(f"`{where}` must be a boolean", where)
    return StructuredOutput("json_object") if value else None


def _response_format(rf: Any) -> StructuredOutput | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise InvalidRequest("`response_format` must be an object with a string `type`",
                             "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise InvalidRequest("`response_format.json_schema` must be an object with a "
                                 "`schema`", "response_format")
        return StructuredOutput("json_schema",
                                _schema_text(js["schema"], "response_format.json_schema.schema"))
    raise InvalidRequest(f"`response_format.type` {kind!r} is not supported; use text, "
                         "json_object or json_schema", "response_format")


def _structured_outputs(so: Any) -> list[tuple[str, StructuredOutput | None]]:
    if not isinstance(so, dict):
        raise InvalidRequest("`structured_outputs` must be an object", "structured_outputs")
    for key, value in so.items():
        if key not in _SO_FIELDS and key not in _SO_OPTIONS and value not in (
                None, False):
            raise InvalidRequest(f"`structured_outputs.{key}` is not supported",
                                 f"structured_outputs.{key}")
    return [(f"structured_outputs.{f}", _one(f, so[f], f"structured_outputs.{f}"))
            for f in _SO_FIELDS if so.get(f) is not None]


def structured_from_body(body: dict[str, Any],
                         forced: tuple[str, StructuredOutput] | None = None,
                         ) -> StructuredOutput | None:
    """The request's constraint, or None. `forced`: (its source, constraint) imposed by
    something else in the request (tool_choice required or named); it counts as one
    more constraint."""
    found: list[tuple[str, StructuredOutput | None]] = []
    if body.get("response_format") is not None:
        found.append(("response_format", _response_format(body["response_format"])))
    if body.get("structured_outputs") is not None:
        found += _structured_outputs(body["structured_outputs"])
    for f in _SO_FIELDS:
        key = "guided_json_object" if f == "json_object" else f"guided_{f}"
        if body.get(key) is not None:
            found.append((key, _one(f, body[key], key)))
    backend = body.get("guided_decoding_backend")
    if backend is not None and (not isinstance(backend, str) or backend.split(":")[0]
                                not in ("xgrammar", "auto")):
        raise InvalidRequest(f"`guided_decoding_backend` {backend!r} is not available; this "
                             "server decodes structured outputs with xgrammar",
                             "guided_decoding_backend")
    for key in ("guided_whitespace_pattern", "structural_tag"):
        if body.get(key) is not None:
            raise InvalidRequest(f"`{key}` is not supported by this server", key)
    if forced is not None:
        found.append(forced)
    real = [(src, c) for src, c in found if c is not None]
    if len(real) > 1:
        raise InvalidRequest("You can only use one kind of structured outputs constraint "
                             f"but multiple are specified: {', '.join(s for s, _ in real)}",
                             real[1][0])
    if not real:
        return None
    return replace(real[0][1], any_whitespace=False) if _compact(body) else real[0][1]


def _compact(body: dict[str, Any]) -> bool:
    """vLLM's disable_any_whitespace: `structured_outputs.disable_any_whitespace`, or
    the older `guided_decoding_backend` option "xgrammar:disable-any-whitespace"."""
    so = body.get("structured_outputs")
    flag = so.get("disable_any_whitespace") if isinstance(so, dict) else None
    if flag is not None and not isinstance(flag, bool):
        raise InvalidRequest("`structured_outputs.disable_any_whitespace` must be a boolean",
                             "structured_outputs.disable_any_whitespace")
    backend = body.get("guided_decoding_backend")
    options = backend.split(":", 1)[1].split(",") if isinstance(backend, str) \
        and ":" in backend else []
    return bool(flag) or "disable-any-whitespace" in options
