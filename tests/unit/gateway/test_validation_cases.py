"""The Python gateway's side of operator/pdserve/dataplane/testdata/validation_cases.json: the
intake refuses every `refused` case with a 400 naming its parameter and accepts every
`accepted` one. The data plane's test reads the same file: its fast path serves none of the
refused ones, so a client gets this 400 whichever path its request takes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request

from pdserve.gateway.errors import GatewayError
from pdserve.gateway.intake import Intake
from pdserve.gateway.settings import GatewaySettings

CASES_FILE = (
    Path(__file__).resolve().parents[3]
    / "operator/pdserve/dataplane/testdata/validation_cases.json"
)
CASES: dict[str, list[dict[str, Any]]] = json.loads(CASES_FILE.read_text())


def intake_answer(case: dict[str, Any]) -> dict[str, Any]:
    """What the Python gateway's intake makes of the case: the body it serves, or raises."""
    request = make_mocked_request("POST", case["path"], headers=case["headers"])
    intake = Intake("qwen", GatewaySettings())
    body = intake.read_body(request, case["body"].encode())
    return intake.check_body(body, chat=case["path"] == "/v1/chat/completions")


@pytest.mark.parametrize("case", CASES["refused"], ids=lambda case: case["name"])
def test_the_python_gateway_refuses_each_case_naming_its_parameter(case: dict[str, Any]) -> None:
    with pytest.raises(GatewayError) as refused:
        intake_answer(case)
    assert refused.value.status == 400
    assert refused.value.param == case["param"]


@pytest.mark.parametrize("case", CASES["accepted"], ids=lambda case: case["name"])
def test_the_python_gateway_accepts_each_valid_case(case: dict[str, Any]) -> None:
    assert intake_answer(case)["model"] == "qwen"
