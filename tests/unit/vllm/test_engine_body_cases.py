"""The Python gateway's side of operator/pdserve/dataplane/testdata/engine_bodies.json: the
engine requests each route sends (prefill and decode, to OpenAI and to tokens engines), the
derender request, and the corrections that make a derendered answer what `vllm serve`
answers. The data plane's test (engine_bodies_test.go) reads the same file, so an engine
gets the same request whichever process sends it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.vllm.derender_gaps import match_vllm_serve, without_stop_tokens
from pdserve.vllm.protocol import (
    derender_body,
    openai_decode_body,
    openai_prefill_body,
    prefill_handoff_params,
    tokens_decode_body,
    tokens_prefill_body,
)

CASES_FILE = (
    Path(__file__).resolve().parents[3] / "operator/pdserve/dataplane/testdata/engine_bodies.json"
)
CASES: dict[str, Any] = json.loads(CASES_FILE.read_text())


def ids(case: dict[str, Any]) -> str:
    return str(case["name"])


@pytest.mark.parametrize("case", CASES["tokensPrefill"], ids=ids)
def test_a_tokens_prefill_request_is_the_shared_cases(case: dict[str, Any]) -> None:
    assert tokens_prefill_body(case["generate"], prefill_handoff_params()) == case["want"]


@pytest.mark.parametrize("case", CASES["tokensDecode"], ids=ids)
def test_a_tokens_decode_request_is_the_shared_cases(case: dict[str, Any]) -> None:
    assert tokens_decode_body(case["generate"], case["kv"]) == case["want"]


@pytest.mark.parametrize("case", CASES["openaiPrefill"], ids=ids)
def test_an_openai_prefill_request_is_the_shared_cases(case: dict[str, Any]) -> None:
    assert openai_prefill_body(case["request"], prefill_handoff_params()) == case["want"]


@pytest.mark.parametrize("case", CASES["openaiDecode"], ids=ids)
def test_an_openai_decode_request_is_the_shared_cases(case: dict[str, Any]) -> None:
    assert openai_decode_body(case["request"], case["kv"]) == case["want"]


@pytest.mark.parametrize("case", CASES["derender"], ids=ids)
def test_a_derender_request_is_the_shared_cases(case: dict[str, Any]) -> None:
    trimmed = without_stop_tokens(case["answer"], case["params"])
    got = derender_body(
        case["model"], trimmed, case["promptIds"], case["request"], chat=case["chat"]
    )
    assert got == case["want"]


@pytest.mark.parametrize("case", CASES["corrections"], ids=ids)
def test_a_derendered_answer_is_corrected_as_the_shared_case_says(case: dict[str, Any]) -> None:
    result = copy.deepcopy(case["derendered"])
    match_vllm_serve(result, case["answer"], case["params"], case["request"], chat=case["chat"])
    result["model"], result["id"] = "m", "pdserve-1"  # tokens_route.py generate_once
    assert result == case["want"]
