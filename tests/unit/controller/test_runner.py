"""The reconcile runner's promises that no cluster timing can show reliably: what a pass found is
told even when a later step of the pass fails, and a pod deleted under a pass does not fail it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, cast

import httpx
import pytest
from prometheus_client import generate_latest

from pdserve.api import Condition, DisaggregatedModelStatus
from pdserve.controller import runner
from pdserve.controller.reconcile import PARITY_DRIFT, Outcome, PassFailed, annotate_pod
from pdserve.controller.settings import OperatorSettings
from pdserve.kube.client import Kube, KubeError

BODY: dict[str, Any] = {
    "apiVersion": "pdserve.io/v1alpha1",
    "kind": "DisaggregatedModel",
    "metadata": {"name": "qwen", "namespace": "team", "uid": "uid-1", "resourceVersion": "7"},
    "spec": {},
}


def kube_error(status: int, method: str = "PATCH") -> KubeError:
    request = httpx.Request(method, "https://api.test/api/v1/namespaces/team/pods/qwen-prefill-0")
    return KubeError(httpx.Response(status, json={"message": "not here"}, request=request))


class FakeKube:
    """Only what the runner and annotate_pod call; `patch_status_code` fails pod patches."""

    def __init__(self, patch_status_code: int | None = None) -> None:
        self.created: list[dict[str, Any]] = []
        self.patched: list[tuple[str, Mapping[str, Any]]] = []
        self.patch_status_code = patch_status_code

    async def get(self, *_: Any) -> dict[str, Any]:
        return BODY

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        self.created.append(dict(obj))
        return dict(obj)

    async def patch_merge(
        self, _kind: Any, _namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        if self.patch_status_code is not None:
            raise kube_error(self.patch_status_code)
        self.patched.append((name, patch))
        return {}


async def test_a_pass_that_fails_after_repairing_still_posts_what_it_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def repairs_then_fails(*_: Any, **__: Any) -> Outcome:
        outcome = Outcome()
        outcome.event("Warning", "ParityDrift", "repairing: prefill --block-size is '32'")
        error = kube_error(500)
        raise PassFailed(outcome, error) from error

    monkeypatch.setattr(runner, "reconcile", repairs_then_fails)
    kube = FakeKube()
    settings = OperatorSettings(engine_metrics_seconds=0, autoscale_seconds=0)
    reconciler = runner.Reconciler(cast(Kube, kube), settings)
    with pytest.raises(KubeError):
        await reconciler._reconcile_once(("team", "qwen"))
    assert [(e["reason"], e["involvedObject"]["name"]) for e in kube.created] == [
        ("ParityDrift", "qwen")
    ]
    assert "--block-size is '32'" in kube.created[0]["message"]


async def test_annotating_a_pod_deleted_under_the_pass_is_skipped_not_failed() -> None:
    gone = FakeKube(patch_status_code=404)
    assert not await annotate_pod(cast(Kube, gone), "team", "qwen-prefill-0", {"a": "b"})
    present = FakeKube()
    assert await annotate_pod(cast(Kube, present), "team", "qwen-prefill-0", {"a": "b"})
    assert present.patched == [("qwen-prefill-0", {"metadata": {"annotations": {"a": "b"}}})]


async def test_other_errors_annotating_a_pod_still_fail_the_pass() -> None:
    with pytest.raises(KubeError, match="403"):
        await annotate_pod(cast(Kube, FakeKube(patch_status_code=403)), "team", "p", {"a": "b"})


async def test_passes_are_counted_by_model_and_result_with_their_durations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the operator's /metrics tells: passes by result, how long they took, the work
    queue's depth and wait."""
    results = [kube_error(500), None]  # the first pass fails, its retry succeeds

    async def pass_(*_: Any, **__: Any) -> Outcome:
        error = results.pop(0)
        if error is not None:
            raise PassFailed(Outcome(), error) from error
        return Outcome()

    monkeypatch.setattr(runner, "reconcile", pass_)
    settings = OperatorSettings(engine_metrics_seconds=0, autoscale_seconds=0,
                                retry_max_seconds=0.01)  # fmt: skip
    reconciler = runner.Reconciler(cast(Kube, FakeKube()), settings)
    reconciler.trigger("team", "qwen")
    await reconciler.drain()
    text = generate_latest(reconciler.registry).decode()
    for line in (
        'pdserve_operator_reconcile_total{model="qwen",namespace="team",result="error"} 1.0',
        'pdserve_operator_reconcile_total{model="qwen",namespace="team",result="success"} 1.0',
        'pdserve_operator_reconcile_duration_seconds_count{result="success"} 1.0',
        "pdserve_operator_workqueue_depth 0.0",
        "pdserve_operator_workqueue_queue_duration_seconds_count 2.0",
    ):
        assert line in text, text


def condition(type_: str, status: Literal["True", "False"], reason: str) -> Condition:
    return Condition(type=type_, status=status, reason=reason, last_transition_time="t")


async def test_each_model_s_conditions_and_repaired_drift_are_served_until_it_goes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the chart's alerts read: one series per condition of the model's last status (the
    previous reason's goes), the drift repairs counted from 0, all gone with the model, and
    nothing left on a replica that stops leading."""
    passes: list[tuple[list[Condition], int]] = [
        ([condition("Ready", "False", "PoolsNotReady"),
          condition("TransportVerified", "False", "TCPFallback")], 1),
        ([condition("Ready", "True", "AllPoolsReady"),
          condition("TransportVerified", "True", "Verified")], 0),
    ]  # fmt: skip

    async def pass_(*_: Any, **__: Any) -> Outcome:
        conditions, drifts = passes.pop(0)
        outcome = Outcome(status=DisaggregatedModelStatus(conditions=conditions))
        for _drift in range(drifts):
            outcome.event("Warning", PARITY_DRIFT, "repairing: prefill --block-size")
        return outcome

    monkeypatch.setattr(runner, "reconcile", pass_)
    settings = OperatorSettings(engine_metrics_seconds=0, autoscale_seconds=0)
    reconciler = runner.Reconciler(cast(Kube, FakeKube()), settings)
    registry = reconciler.registry
    labels = {"namespace": "team", "model": "qwen"}

    def shown() -> set[tuple[str, str, str]]:
        return {
            (s.labels["condition"], s.labels["status"], s.labels["reason"])
            for family in registry.collect() if family.name == "pdserve_operator_model_condition"
            for s in family.samples if s.value == 1 and s.labels["model"] == "qwen"
        }  # fmt: skip

    reconciler.trigger("team", "qwen")
    await reconciler.drain()
    assert shown() == {("Ready", "False", "PoolsNotReady"),
                       ("TransportVerified", "False", "TCPFallback")}  # fmt: skip
    assert registry.get_sample_value("pdserve_operator_parity_drift_total", labels) == 1
    reconciler.trigger("team", "qwen")
    await reconciler.drain()
    assert shown() == {
        ("Ready", "True", "AllPoolsReady"),
        ("TransportVerified", "True", "Verified"),
    }
    assert registry.get_sample_value("pdserve_operator_parity_drift_total", labels) == 1

    reconciler.forget("team", "qwen")
    assert shown() == set()
    assert registry.get_sample_value("pdserve_operator_parity_drift_total", labels) is None

    passes.append(([condition("Ready", "True", "AllPoolsReady")], 0))
    reconciler.trigger("team", "qwen")
    await reconciler.drain()
    # A new model's counter starts at 0, so the first drift is an increase Prometheus sees.
    assert registry.get_sample_value("pdserve_operator_parity_drift_total", labels) == 0
    reconciler.step_down()
    assert shown() == set()
    assert registry.get_sample_value("pdserve_operator_parity_drift_total", labels) is None
