from __future__ import annotations

import pytest
import yaml

from pdserve.yamlio import dump


@pytest.mark.parametrize("value", ["123e4567", "1234", "0x1f", "1_000", "inf", "1.5", ".5"])
def test_strings_a_go_yaml_reader_would_take_for_numbers_are_quoted(value: str) -> None:
    text = dump({"hash": value})
    assert text == f"hash: '{value}'\n"
    assert yaml.safe_load(text) == {"hash": value}


def test_plain_and_multiline_strings() -> None:
    assert dump({"a": "abc123", "b": "x\ny\n"}) == "a: abc123\nb: |\n  x\n  y\n"
