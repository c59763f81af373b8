"""JSON as the gateway sends and reads it: orjson, several times the standard library's speed
(JSON is most of a proxy's CPU on large prompts), with the standard library behind it for what
orjson refuses and Python's `json` accepts (NaN and Infinity, which Python clients send, lone
surrogates, deep nesting), so such a body reads and travels as it did before, and its errors are
the standard library's (naming the field, or the number too long to read). One difference stays:
an integer past 64 bits in otherwise valid JSON reads as a float (no engine takes one)."""

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


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """The JSON value in `data`; ValueError (JSONDecodeError for malformed text) or
    RecursionError as the standard library raises them."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        text = data if isinstance(data, str) else bytes(data).decode()
        return json.loads(text)
