"""The Python gateway's side of operator/pdserve/dataplane/testdata/stream_stop_cases.json: a
streamed choice's derendered chunks behind render servers, the stop string that ended the
last, and what the client must get of each (what vLLM 0.32 streams: the tail that may begin a
stop string held back until the end). The data plane's test reads the same file, so a
stop string ends a stream at the same character whichever path serves it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.vllm.derender_gaps import StreamStop

CASES_FILE = (
    Path(__file__).resolve().parents[3]
    / "operator/pdserve/dataplane/testdata/stream_stop_cases.json"
)
CASES: list[dict[str, Any]] = json.loads(CASES_FILE.read_text())


@pytest.mark.parametrize("case", CASES, ids=lambda case: case["name"])
def test_stop_strings_are_cut_across_chunks_as_the_data_plane_cuts_them(
    case: dict[str, Any],
) -> None:
    stops = StreamStop(case["request"])
    for step in case["steps"]:
        choice = copy.deepcopy(step["choice"])
        stops.correct(choice, step["stop"], final=step["final"])
        assert choice == step["want"]
