"""A request body as the gateway first reads it: strict JSON, the client's request id,
and typed reads of its fields. Every error is InvalidRequest (400) with vLLM's wording
where vLLM has one; nothing here knows what a field means (gateway/sampling.py and
gateway/protocol.py do).
"""

from __future__ import annotations

import re
from array import array
from typing import Any

import msgspec

from gateway.errors import InvalidRequest

MAX_JSON_DEPTH = 64  # arrays / objects inside each other (JSON schemas stay far below)
MAX_JSON_INT = 2**64  # no field holds more; larger ones cannot even become a float


_decode = msgspec.json.Decoder().decode
_decode_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_CONTAINERS = (list, dict)
# A body this long is parsed off the event loop, in pieces (see parse_json).
PIECEWISE_BYTES = 1 << 18
_PIECE_BYTES = 1 << 16  # ~10k token ids: ~1 ms of msgspec per piece
_PIECE_ITEMS = 1 << 14
_INT_ARRAY_CHARS = b"0123456789,- \t\r\n"


def parse_json(raw: bytes) -> Any:
    """A request body as strict JSON: UTF-8, finite numbers (no NaN / Infinity, none
    beyond 64-bit integers or doubles), strings of Unicode scalar values (no lone
    surrogates, which cannot be encoded again: tokenizer, protobuf, logs), nested at most
    MAX_JSON_DEPTH deep. Anything else is InvalidRequest (400) here, before any field
    is read. msgspec parses (in C, ~20x the standard library's strict hooks on a long
    token-id prompt) and refuses all but the integer range and the depth, checked after.

    A body of PIECEWISE_BYTES or more is parsed in pieces of about a millisecond each, so
    that a thread parsing it (the HTTP front does, off the event loop) lets the loop run
    between pieces: msgspec holds the GIL for a whole call, ~80 ms on a 4 MiB token-id
    prompt. The result and the errors are the same as one call's."""
    try:
        body = _decode_piecewise(raw) if len(raw) >= PIECEWISE_BYTES else _decode(raw)
        _check_json(body)
    except RecursionError:
        raise InvalidRequest(f"the request body is not valid JSON: nested deeper than "
                             f"{MAX_JSON_DEPTH} levels") from None
    except (msgspec.DecodeError, ValueError) as e:  # (msgspec.ValidationError: a ValueError)
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    return body


def _decode_piecewise(raw: bytes) -> Any:
    """`_decode(raw)`, with each long integer array among an object's fields decoded a
    piece at a time (split at its commas); anything else in one call."""
    try:
        fields = {k: bytes(v) for k, v in _decode_fields(raw).items()}
    except msgspec.DecodeError:  # not an object, or not JSON: one call says which
        return _decode(raw)
    # A repeated key's earlier value was only skipped, which is laxer than decoding it
    # (bad UTF-8, a number out of range pass): then one call. The object's non-blank
    # bytes are its fields' and their punctuation exactly when no key repeats (and each
    # key is written as msgspec writes it; otherwise, one call too). Long values are
    # cut out of both sides rather than counted (counting is a pass over every byte).
    rest, counted = raw, 1
    for k, v in fields.items():
        counted += _nonblank(msgspec.json.encode(k)) + 2
        if len(v) < 2 * _PIECE_BYTES:
            counted += _nonblank(v)
        else:
            at = rest.find(v)
            rest = rest[:at] + rest[at + len(v):]
    if _nonblank(rest) != max(counted, 2):
        return _decode(raw)
    try:
        return {k: _decode_field(v) for k, v in fields.items()}
    except _NotIntArray:  # a string in a long array: a split may fall inside it
        return _decode(raw)


class _NotIntArray(Exception):
    pass


def _nonblank(raw: bytes) -> int:
    """The count of bytes other than JSON's whitespace."""
    return len(raw.translate(None, b" \t\r\n"))


def _decode_field(raw: bytes) -> Any:
    if len(raw) < 2 * _PIECE_BYTES or raw[:1] != b"[" or raw[-1:] != b"]" \
            or raw[1:_PIECE_BYTES].translate(None, _INT_ARRAY_CHARS):
        return _decode(raw)
    out: list[Any] = []
    inner, start = raw[1:-1], 0
    while True:
        end = inner.find(b",", start + _PIECE_BYTES)
        piece = inner[start:end] if end >= 0 else inner[start:]
        if piece.translate(None, _INT_ARRAY_CHARS):  # checked a piece at a time
            raise _NotIntArray
        if not piece.strip():  # `[1,,2]` or `[1,]` split at the empty item
            raise ValueError("an array item is missing")
        out.extend(_decode(b"[" + piece + b"]"))
        if end < 0:
            return out
        start = end + 1


def _check_json(body: Any) -> None:
    """Raises ValueError for an integer beyond 64 bits or nesting past MAX_JSON_DEPTH.
    Iterative (no recursion on the client's structure), and the per-element work of a
    long array (a token-id prompt) stays in C: its element types as a set, min and max."""
    if type(body) is int:
        _check_ints([body])
    stack = [(body, 0)] if isinstance(body, _CONTAINERS) else []
    while stack:
        v, depth = stack.pop()
        if depth >= MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
        items = v if isinstance(v, list) else list(v.values())
        if _in_int64(items):  # a token-id prompt: one pass in C, nothing nested
            continue
        kinds = set(map(type, items))
        if int in kinds:
            _check_ints(items if kinds == {int} else [x for x in items if type(x) is int])
        if list in kinds or dict in kinds:
            stack.extend((x, depth + 1) for x in items if isinstance(x, _CONTAINERS))


def _in_int64(items: list[Any]) -> bool:
    """True when every item is an integer within 64-bit signed range (then none is out of
    range and none is a container); False says only that the slow path must look."""
    if len(items) < 64:
        return False
    try:
        for i in range(0, len(items), _PIECE_ITEMS):  # in pieces: see parse_json
            array("q", items[i:i + _PIECE_ITEMS])
    except (TypeError, OverflowError):
        return False
    return True


def _check_ints(ints: list[int]) -> None:
    if ints and (min(ints) <= -MAX_JSON_INT or max(ints) >= MAX_JSON_INT):
        text = str(max(ints, key=abs))
        raise ValueError(f"integer {text[:32]}{'...' if len(text) > 32 else ''} is out of "
                         "range (at most 64 bits)")


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

