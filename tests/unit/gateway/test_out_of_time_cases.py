"""The Python gateway's side of operator/pdserve/dataplane/testdata/out_of_time.json: a call
that ran out of time is named by what never came, the connection or the answer. The data
plane's test (failures_test.go) reads the same file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdserve.gateway.errors import out_of_time

CASES_FILE = (
    Path(__file__).resolve().parents[3] / "operator/pdserve/dataplane/testdata/out_of_time.json"
)
CASES: list[dict[str, Any]] = json.loads(CASES_FILE.read_text())


@pytest.mark.parametrize("case", CASES, ids=lambda case: case["name"])
def test_a_call_out_of_time_is_named_as_the_shared_case_says(case: dict[str, Any]) -> None:
    # aiohttp's sock_connect timeout, or the call's own bound (asyncio's TimeoutError).
    error = TimeoutError() if case["connectionMade"] else aiohttp.ConnectionTimeoutError()
    message = out_of_time(case["stage"], case["url"], error, case["waited"], case["connectTimeout"])
    assert message == case["message"]
