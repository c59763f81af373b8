"""One reconcile pass against an in-memory API server: it returns what it did (a value), a pass
that fails part-way raises what it did until then (and the runner tells it), and kinds the
operator may not list are warned about once per Reconciler (no module state)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import pytest

from pdserve.controller import runner
from pdserve.controller.children import NETWORK_POLICY, list_children
from pdserve.controller.reconcile import PassFailed
from pdserve.controller.settings import OperatorSettings
from pdserve.kube.client import Kube, KubeError
from tests.support.fakekube import NAME, NS, SPEC, FakeKube, model_in, one_pass, settled


async def test_a_pass_returns_what_it_did() -> None:
    kube = FakeKube()
    model_in(kube)
    outcome = await one_pass(kube)
    assert "StatefulSet/qwen-prefill" in outcome.applied
    assert outcome.status_written
    assert outcome.status is not None
    assert outcome.status.phase == "Progressing"


def drift_block_size(kube: FakeKube) -> None:
    prefill = kube.objects[("StatefulSet", NS, "qwen-prefill")]
    args = prefill["spec"]["template"]["spec"]["containers"][0]["args"]
    args[args.index("--block-size") + 1] = "32"


async def test_a_pass_that_fails_part_way_raises_what_it_found_with_the_error() -> None:
    kube = FakeKube()
    model_in(kube)
    await settled(kube)
    drift_block_size(kube)
    kube.fail_on = "apply"
    with pytest.raises(PassFailed) as raised:
        await one_pass(kube)
    failed = raised.value
    assert isinstance(failed.error, KubeError)
    assert failed.__cause__ is failed.error
    assert [e.reason for e in failed.outcome.events] == ["ParityDrift"]


async def test_the_runner_tells_what_a_failed_pass_found_then_raises_its_error() -> None:
    kube = FakeKube()
    model_in(kube)
    await settled(kube)
    drift_block_size(kube)
    kube.fail_on = "apply"
    settings = OperatorSettings(engine_metrics_seconds=0, autoscale_seconds=0)
    reconciler = runner.Reconciler(cast(Kube, kube), settings)
    with pytest.raises(KubeError):
        await reconciler._reconcile_once((NS, NAME))
    assert [e["reason"] for e in kube.created] == ["ParityDrift"]


async def test_a_forbidden_kind_is_warned_about_once_per_warned_set(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kube = FakeKube()
    kube.forbidden = {"NetworkPolicy"}
    optional = frozenset({NETWORK_POLICY})

    def warnings() -> int:
        return sum("may not list NetworkPolicy" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="pdserve.reconcile"):
        warned: set[str] = set()
        for _ in range(2):
            await list_children(cast(Kube, kube), NS, NAME, optional=optional, warned=warned)
        assert (warnings(), warned) == (1, {"NetworkPolicy"})
        # Another operator (another Reconciler, another set) has not warned yet: no module state.
        await list_children(cast(Kube, kube), NS, NAME, optional=optional, warned=set())
        assert warnings() == 2


async def test_each_reconciler_keeps_its_own_warnings(caplog: pytest.LogCaptureFixture) -> None:
    settings = OperatorSettings(engine_metrics_seconds=0, autoscale_seconds=0)
    kube = FakeKube()
    kube.forbidden = {"NetworkPolicy"}
    model_in(kube)
    first, second = (runner.Reconciler(cast(Kube, kube), settings) for _ in range(2))
    with caplog.at_level(logging.WARNING, logger="pdserve.reconcile"):
        for reconciler in (first, first, second):
            await reconciler._reconcile_once((NS, NAME))
    assert sum("may not list NetworkPolicy" in r.getMessage() for r in caplog.records) == 2
    assert first.warned_forbidden == second.warned_forbidden == {"NetworkPolicy"}


def stall_applies(kube: FakeKube) -> asyncio.Event:
    """Applies wait forever (to cancel a pass in the middle); set once the first one waits."""
    started = asyncio.Event()

    async def stalled(*_: Any, **__: Any) -> Any:
        started.set()
        await asyncio.Event().wait()

    kube.apply = stalled  # type: ignore[method-assign]
    return started


async def test_a_cancelled_pass_still_hands_over_what_it_found() -> None:
    kube = FakeKube()
    model_in(kube)
    await settled(kube)
    drift_block_size(kube)
    started = stall_applies(kube)
    task = asyncio.create_task(one_pass(kube))
    await started.wait()
    task.cancel()
    with pytest.raises(PassFailed) as raised:
        await task
    assert isinstance(raised.value.error, asyncio.CancelledError)
    assert [e.reason for e in raised.value.outcome.events] == ["ParityDrift"]


async def test_the_runner_tells_what_a_cancelled_pass_found_and_stays_cancelled() -> None:
    kube = FakeKube()
    model_in(kube)
    await settled(kube)
    drift_block_size(kube)
    started = stall_applies(kube)
    settings = OperatorSettings(engine_metrics_seconds=0, autoscale_seconds=0)
    reconciler = runner.Reconciler(cast(Kube, kube), settings)
    task = asyncio.create_task(reconciler._reconcile_once((NS, NAME)))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert [e["reason"] for e in kube.created] == ["ParityDrift"]


async def test_a_field_of_a_newer_crd_is_ignored_with_one_warning_not_a_failed_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kube = FakeKube()
    model_in(kube, {**SPEC, "decode": {"replicas": 1, "futureDrain": 5}})
    warned: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="pdserve.reconcile"):
        for _ in range(2):
            outcome = await one_pass(kube, warned=warned)
            assert outcome.problems == []
            assert outcome.status is not None
            assert outcome.status.phase != "Failed"
    assert ("StatefulSet", NS, "qwen-decode") in kube.objects
    newer = [r for r in caplog.records if "spec.decode.futureDrain: not known" in r.getMessage()]
    assert len(newer) == 1


WIDE = {**SPEC, "model": {"name": "deepseek-ai/DeepSeek-R1-0528"},
        "decode": {"replicas": 1, "nodesPerReplica": 2, "dataParallelSize": 8}}  # fmt: skip


async def test_a_model_spanning_nodes_without_the_leaderworkerset_api_fails_naming_the_fix() -> (
    None
):
    kube = FakeKube()
    kube.unserved.add("LeaderWorkerSet")
    model_in(kube, WIDE)
    outcome = await one_pass(kube)
    assert outcome.status is not None
    assert outcome.status.phase == "Failed"
    ready = {c.type: c for c in outcome.status.conditions}["Ready"]
    assert ready.reason == "MissingAPI"
    assert ready.message.startswith("spec.decode.nodesPerReplica above 1 runs each replica as a "
                                    "LeaderWorkerSet group, but this cluster does not serve "
                                    "leaderworkerset.x-k8s.io/v1 LeaderWorkerSet")  # fmt: skip
    assert outcome.applied == []  # nothing half-made
    assert [e.reason for e in outcome.events] == ["MissingAPI"]


async def test_a_model_spanning_nodes_gets_a_leaderworkerset_and_a_statefulset_for_the_rest() -> (
    None
):
    kube = FakeKube()
    model_in(kube, WIDE)
    outcome = await one_pass(kube)
    assert {"LeaderWorkerSet/qwen-decode", "StatefulSet/qwen-prefill"} <= set(outcome.applied)
    assert "StatefulSet/qwen-decode" not in outcome.applied
