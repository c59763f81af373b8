"""JSON as the gateway sends and reads it: orjson, several times the standard library's speed
(JSON is most of a proxy's CPU on large prompts), with the standard library behind it for what
orjson refuses or reads differently and Python's `json` reads exactly (NaN and Infinity, which
Python clients send, lone surrogates, deep nesting, integers past 64 bits), so every body reads
and travels as it did before, and its errors are the standard library's (naming the field, or
the number too long to read)."""

from __future__ import annotations

import json
from typing import Any

import orjson

JSONDecodeError = json.JSONDecodeError
"""What `loads` raises for text that is no JSON (orjson's own error is a subclass)."""


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON."""
    try:
        return orjson.dumps(value)
    except TypeError:  # a lone surrogate, an integer past 64 bits: what json writes
        return json.dumps(value, separators=(",", ":")).encode()


def dumps_text(value: Any) -> str:
    return dumps(value).decode()


def loads(data: bytes | str) -> Any:
    """The JSON value in `data`; ValueError (JSONDecodeError for malformed text) or
    RecursionError as the standard library raises them."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    else:
        if not has_huge_float(value):
            return value
    return json.loads(data if isinstance(data, str) else data.decode())


def loads_trusted(data: bytes | str) -> Any:
    """`loads` for what servers answer (engines, render servers, the Kubernetes API): no
    integers past 64 bits there (token ids, counts, times), so the walk that finds them is
    skipped; it would visit every token id of a long prompt and every field of a list."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data if isinstance(data, str) else data.decode())


INT64_LIMIT = 2.0**63


def has_huge_float(value: Any) -> bool:
    """A float past the 64-bit integers: orjson reads an integer literal that large as one
    (so the text is read again, exactly). Walks the values, not the text: a long prompt is
    one string."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif type(item) is float and not -INT64_LIMIT < item < INT64_LIMIT:
            return True
    return False
