"""The Python gateway's side of operator/pdserve/dataplane/testdata/refusals.json: the refusals
both request paths answer before any engine call, in one wording (the data plane's test,
refusals_test.go, reads the same file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.gateway.errors import (
    GatewayError,
    gateway_owned_refused,
    over_cap,
    stream_logprobs_refused,
    tokenizer_needed,
    too_large,
)
from pdserve.gateway.openai_schema import gateway_owned, needs_tokenizer, validate_request

CASES_FILE = (
    Path(__file__).resolve().parents[3] / "operator/pdserve/dataplane/testdata/refusals.json"
)
CASES: list[dict[str, Any]] = json.loads(CASES_FILE.read_text())


def refusal(case: dict[str, Any]) -> GatewayError | None:
    if case["refusal"] == "too_large":
        return too_large(case["cap"])
    if case["refusal"] == "over_cap":
        return over_cap(case["field"], case["cap"])
    if case["refusal"] == "gateway_owned":
        validate_request(dict(case["body"]), chat=case["chat"])  # a body the schema accepts
        owned = gateway_owned(case["body"])
        return None if owned is None else gateway_owned_refused(owned)
    if case["refusal"] == "needs_tokenizer":
        # What a model whose engines run --tokens-only refuses (intake.check_body).
        needed = needs_tokenizer(validate_request(dict(case["body"]), chat=case["chat"]))
        if needed is None:
            return None
        return tokenizer_needed(needed.param, needed.task, needed.instead)
    assert case["refusal"] == "stream_logprobs", case["refusal"]
    return stream_logprobs_refused(case["field"])


@pytest.mark.parametrize("case", CASES, ids=lambda case: case["name"])
def test_a_refusal_is_worded_as_the_shared_case_says(case: dict[str, Any]) -> None:
    error = refusal(case)
    if case["status"] == 0:  # served, not refused
        assert error is None
        return
    assert error is not None
    assert (error.status, error.kind, error.param, error.message) == (
        case["status"], case["type"], case["param"], case["message"]
    )  # fmt: skip
