"""The Python gateway's side of operator/pdserve/dataplane/testdata/error_bodies.json: every
error answer's body, byte for byte, with the headers that go with it. The data plane's test
(error_body_test.go) reads the same file, so an error reads the same whichever path answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.gateway.errors import GatewayError, error_response

CASES_FILE = (
    Path(__file__).resolve().parents[3] / "operator/pdserve/dataplane/testdata/error_bodies.json"
)
CASES: list[dict[str, Any]] = json.loads(CASES_FILE.read_text())


@pytest.mark.parametrize("case", CASES, ids=lambda case: case["name"])
def test_an_error_answer_is_the_shared_body(case: dict[str, Any]) -> None:
    error = GatewayError(case["status"], case["message"], param=case["param"], kind=case["type"])
    response = error_response(error)
    assert response.status == case["status"]
    assert response.body == case["body"].encode()
    assert response.content_type == "application/json"
    retry = response.headers.get("Retry-After")
    assert retry == ("1" if case["status"] in (429, 503) else None)


def test_the_types_a_status_gets_by_default_are_the_shared_ones() -> None:
    """Where a case's type is its status's default, the Python gateway names it so by itself
    (the data plane writes the type at each call site)."""
    defaults = {c["status"]: c["type"] for c in CASES if c["status"] != 504}
    for status, kind in defaults.items():
        assert GatewayError(status, "m").kind == kind, status
