"""The wire codec reads and writes what Python's json does, fast where orjson can."""

from __future__ import annotations

import json
import math

import pytest

from pdserve.wirejson import JSONDecodeError, dumps, loads, loads_trusted


def test_plain_bodies_round_trip_compact_and_utf8() -> None:
    body = {"messages": [{"role": "user", "content": "héllo \u2028"}], "max_tokens": 8}
    assert dumps(body) == json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    assert loads(dumps(body)) == body


def test_what_clients_send_that_orjson_refuses_reads_as_json_reads_it() -> None:
    # Python clients send NaN; lone surrogates are valid for json too.
    body = loads(b'{"t": NaN, "s": "\\ud800", "n": 123456789012345678901234567890}')
    assert math.isnan(body["t"])
    assert body["s"] == "\ud800"
    assert body["n"] == 123456789012345678901234567890
    again = loads(dumps(body))  # and goes upstream as it came
    assert again["s"] == "\ud800"
    assert again["n"] == body["n"]


def test_integers_past_64_bits_read_exactly() -> None:
    body = loads(b'{"conversation_id": -9223372036854775809, "n": 1}')
    assert body["conversation_id"] == -9223372036854775809
    assert isinstance(body["conversation_id"], int)
    assert loads('{"seed": 12345678901234567890123}')["seed"] == 12345678901234567890123


def test_malformed_text_and_numbers_too_long_raise_what_json_raises() -> None:
    with pytest.raises(JSONDecodeError):
        loads(b'{"a": ')
    with pytest.raises(ValueError, match="4300"):
        loads(b'{"max_tokens": ' + b"9" * 5000 + b"}")


def test_servers_answers_read_fast_and_still_take_what_json_takes() -> None:
    assert loads_trusted(b'{"token_ids": [1, 2, 3]}') == {"token_ids": [1, 2, 3]}
    assert math.isnan(loads_trusted(b'{"x": NaN}')["x"])
