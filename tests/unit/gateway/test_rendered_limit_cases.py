"""The Python gateway's side of operator/pdserve/dataplane/testdata/rendered_limit_cases.json:
the sampling params of a rendered generate request, as render answered them, and as the engine
must get them. The data plane's test reads the same file, so the engine gets one limit
whichever path a request takes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.vllm.protocol import with_rendered_limit

CASES_FILE = (
    Path(__file__).resolve().parents[3]
    / "operator/pdserve/dataplane/testdata/rendered_limit_cases.json"
)
CASES: list[dict[str, Any]] = json.loads(CASES_FILE.read_text())


@pytest.mark.parametrize("case", CASES, ids=lambda case: case["name"])
def test_the_engine_gets_the_limit_render_resolved(case: dict[str, Any]) -> None:
    token_ids = [1, 2, 3]
    generate = {"request_id": "chatcmpl-1", "token_ids": token_ids,
                "sampling_params": case["rendered"], "stream": False}  # fmt: skip
    sent = with_rendered_limit(generate)
    assert sent == {**generate, "sampling_params": case["engine"]}
    assert sent["token_ids"] is token_ids  # the prompt is shared, not copied
    assert generate["sampling_params"] == case["rendered"]  # render's answer left as it came
