"""ContractVerified from the gateways' replica-check Events: each pod's latest verdict counts,
pods that are gone do not, and a pod kept out of routing makes the model Degraded, named."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.builders import Component
from pdserve.contract.names import (
    GATEWAY_EVENT_REPORTER,
    REPLICA_MISMATCH_REASON,
    REPLICA_VERIFIED_REASON,
)
from pdserve.controller.replica_check import replica_mismatches
from pdserve.controller.status import Observation, compute_status
from pdserve.kube.events import event_object
from tests.support.fakekube import NAME, NS, FakeKube, model_in, one_pass, settled
from tests.unit.controller.test_controller import DM, workload


def pod(name: str, uid: str, component: str = "render") -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": uid,
                         "labels": {"app.kubernetes.io/component": component}}}  # fmt: skip


def event(uid: str, reason: str, at: str, version: int, message: str = "") -> dict[str, Any]:
    return {"metadata": {"resourceVersion": str(version)}, "involvedObject": {"uid": uid},
            "reason": reason, "lastTimestamp": at, "message": message}  # fmt: skip


MISMATCH = "kept out of routing by gateway g-1: derender reasoning differs from 2 other replica(s)"


def test_each_pods_latest_verdict_counts_and_gone_pods_do_not() -> None:
    pods = [pod("m-render-a", "a"), pod("m-render-b", "b")]
    events = [
        event("a", REPLICA_MISMATCH_REASON, "2026-12-02T10:00:00Z", 5, MISMATCH),
        event("b", REPLICA_MISMATCH_REASON, "2026-12-02T10:00:00Z", 6, "old"),
        # b rejoined its group in the same second: the write order decides.
        event("b", REPLICA_VERIFIED_REASON, "2026-12-02T10:00:00Z", 7),
        event("gone", REPLICA_MISMATCH_REASON, "2026-12-02T10:00:00Z", 8, "a deleted pod"),
        event("a", "Pulled", "2026-12-02T10:00:09Z", 9),  # not a verdict
    ]
    assert replica_mismatches(pods, events) == [f"render pod m-render-a: {MISMATCH}"]


def test_a_pod_kept_out_of_routing_makes_the_model_degraded_and_not_verified() -> None:
    ok = workload(1, 1)
    pools: dict[Component, list[Mapping[str, Any]]] = {
        Component(name): [ok] for name in ("prefill", "decode", "render", "gateway")
    }
    mismatch = [f"render pod m-render-a: {MISMATCH}"]
    status = compute_status(DM, Observation(workloads=pools, replica_mismatches=mismatch), None,
                            generation=3, parity="abc", now="t")  # fmt: skip
    by_type = {c.type: c for c in status.conditions}
    verified = by_type["ContractVerified"]
    assert (verified.status, verified.reason) == ("False", "ReplicaMismatch")
    assert verified.message == mismatch[0]
    assert status.phase == "Degraded"
    assert (by_type["Degraded"].reason, by_type["Degraded"].message) == (
        "ReplicaMismatch",
        mismatch[0],
    )
    clean = compute_status(DM, Observation(workloads=pools, replica_mismatches=[]), None,
                           generation=3, parity="abc", now="t")  # fmt: skip
    verified = next(c for c in clean.conditions if c.type == "ContractVerified")
    assert (clean.phase, verified.status, verified.reason) == ("Ready", "True", "NoMismatch")
    off = compute_status(DM, Observation(workloads=pools), None, generation=3, parity="abc",
                         now="t")  # fmt: skip
    verified = next(c for c in off.conditions if c.type == "ContractVerified")
    assert (verified.status, verified.reason) == ("Unknown", "CheckOff")


async def test_a_pass_reads_the_gateways_events_into_contract_verified() -> None:
    kube = FakeKube()
    model_in(kube)
    await settled(kube)
    render = pod(f"{NAME}-render-abc", "render-uid")
    render["metadata"].update(namespace=NS, labels={
        "app.kubernetes.io/instance": NAME, "app.kubernetes.io/managed-by": "pdserve",
        "app.kubernetes.io/component": "render",
    })  # fmt: skip
    await kube.create({"apiVersion": "v1", "kind": "Pod", **render})
    body = {"apiVersion": "v1", "kind": "Pod", **render}
    mismatch = event_object(body, "Warning", REPLICA_MISMATCH_REASON, MISMATCH,
                            reporter=GATEWAY_EVENT_REPORTER)  # fmt: skip
    other = event_object(body, "Warning", REPLICA_MISMATCH_REASON, "from someone else",
                         reporter="not-the-gateway")  # fmt: skip
    for posted in (mismatch, other):
        kube.put(posted)  # as the gateway posted it (FakeKube.create records only ours)
    outcome = await one_pass(kube)
    assert outcome.status is not None
    verified = next(c for c in outcome.status.conditions if c.type == "ContractVerified")
    assert (verified.status, verified.message) == (
        "False",
        f"render pod {NAME}-render-abc: {MISMATCH}",
    )
