"""The Python gateway's side of operator/pdserve/dataplane/testdata/auto_decision_cases.json:
Auto mode's per-request decision (P/D or local prefill, why, where) from one view of what was
learnt. The data plane's test (auto_test.go) reads the same file, so a request is decided the
same whichever process decides it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.gateway.policy import AutoPolicy, AutoView, QueueState, decide_with

CASES_FILE = (
    Path(__file__).resolve().parents[3]
    / "operator/pdserve/dataplane/testdata/auto_decision_cases.json"
)
CASES: list[dict[str, Any]] = json.loads(CASES_FILE.read_text())
QUEUE_NAMES = {
    "decodeActive": "decode_active",
    "prefillAhead": "prefill_ahead",
    "prefillAheadBy": "prefill_ahead_by",
    "decodeStepSeconds": "decode_step_seconds",
    "prefillBacklogBy": "prefill_backlog_by",
}


@pytest.mark.parametrize("case", CASES, ids=lambda case: case["name"])
def test_a_request_is_decided_as_the_shared_case_says(case: dict[str, Any]) -> None:
    asked: list[bool] = []

    def probe() -> bool:
        asked.append(True)
        return bool(case["probe"])

    decision = decide_with(
        AutoView.from_wire(case["view"]),
        prompt_tokens=case["promptTokens"],
        prefill_available=case["prefillAvailable"],
        queues=QueueState(**{QUEUE_NAMES[k]: v for k, v in case["queues"].items()}),
        prefill_replicas=case["prefillReplicas"],
        probe=probe,
    )
    want = case["want"]
    assert (decision.disaggregated, decision.reason, decision.anywhere, list(decision.prefill)) == (
        want["disaggregated"], want["reason"], want["anywhere"], want["prefill"]
    )  # fmt: skip
    assert len(asked) == (1 if want["reason"] in ("probe", "degraded") else 0)


def test_the_cases_say_every_reason_auto_mode_gives() -> None:
    reasons = {case["want"]["reason"] for case in CASES}
    assert reasons == {
        "no_prefill", "short_prompt", "degraded", "probe", "decode_idle", "handoff_unknown",
        "handoff_over_ttft_budget", "kv_path_over_ttft_budget", "prefill_queue_over_ttft_budget",
        "local_would_break_itl", "long_prompt",
    }  # fmt: skip


def test_the_view_pushed_to_the_data_plane_reads_back_as_the_policy_holds_it() -> None:
    now = [100.0]
    policy = AutoPolicy(clock=lambda: now[0])
    policy.health.observe(0.5, 1000, 1.0, "http://p1:8000")
    policy.health.observe_prefill(0.2, 1000)
    policy.observe_output(40)
    view = policy.view(1.0, 0.05)
    assert AutoView.from_wire(json.loads(json.dumps(view.to_wire()))) == view
    assert view.by_prefill == {"http://p1:8000": 0.0005}
    now[0] += policy.settings.failure_window_seconds + 1  # too old to trust: not pushed
    assert policy.view(1.0, 0.05).by_prefill == {}
