"""A request body as the gateway first reads it: strict JSON, the client's request id,
and typed reads of its fields. Every error is InvalidRequest (400) with vLLM's wording
where vLLM has one; nothing here knows what a field means (gateway/sampling.py and
gateway/protocol.py do).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from gateway.errors import InvalidRequest

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


def body_object(body: Any) -> dict[str, Any]:
    """The parsed body of an endpoint that takes a JSON object."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def get_field(body: dict[str, Any], key: str, kind: type | tuple[type, ...],
              default: Any) -> Any:
    """`body[key]` when given (not null) and of `kind`, else `default`; InvalidRequest
    naming the field when it has another type (a boolean is no number here)."""
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

