"""What a user reads while a model loads: Available (it serves) apart from Ready (every replica
rolled out), what each pod still waits on and for how long, and a pod past
spec.progressDeadlineSeconds named in Progressing=False and Degraded."""

from __future__ import annotations

from typing import Any

from pdserve.api import DisaggregatedModel, parse_resource
from pdserve.api.status import Condition, DisaggregatedModelStatus
from pdserve.builders import Component
from pdserve.builders.leaderworkerset import GROUP_INDEX_LABEL, WORKER_INDEX_LABEL
from pdserve.contract.names import LWS_NAME_LABEL, LWS_SIZE_ANNOTATION
from pdserve.controller.status import (
    Observation,
    compute_status,
    placement_condition,
    pool_status,
)
from tests.unit.api.test_api import resource
from tests.unit.controller.test_controller import DM, workload

NOW = "2026-12-05T12:30:00Z"


def pod(name: str, pool: str, *, created: str, **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "creationTimestamp": created,
                         "labels": {"app.kubernetes.io/component": pool}},
            "spec": {"nodeName": "h200-0"}, "status": status}  # fmt: skip


def status_of(
    pools: dict[str, dict[str, Any]], pods: list[dict[str, Any]], dm: DisaggregatedModel = DM
) -> DisaggregatedModelStatus:
    seen = Observation(workloads={Component(k): [v] for k, v in pools.items()}, pods=pods)
    return compute_status(dm, seen, None, generation=3, parity="abc", now=NOW)


def conditions(status: DisaggregatedModelStatus) -> dict[str, Condition]:
    return {c.type: c for c in status.conditions}


LOADING = pod("m-decode-1", "decode", created="2026-12-05T12:25:00Z",
              containerStatuses=[{"restartCount": 0,
                                  "state": {"running": {"startedAt": "2026-12-05T12:26:48Z"}}}],
              conditions=[{"type": "Ready", "status": "False"}])  # fmt: skip
CREATING = {"restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}
PULLING = pod("m-prefill-0", "prefill", created="2026-12-05T12:28:00Z",
              containerStatuses=[CREATING])  # fmt: skip


def test_a_model_serving_on_some_replicas_is_available_but_not_ready() -> None:
    ok = workload(1, 1)
    status = status_of({"prefill": workload(1, 0), "decode": workload(2, 1), "render": ok,
                        "gateway": ok}, [LOADING, PULLING])  # fmt: skip
    by_type = conditions(status)
    assert by_type["Ready"].status == "False"
    # Routing mode Auto: decode prefills itself while no prefill replica is ready.
    assert (by_type["Available"].status, by_type["Available"].reason) == ("True", "Serving")
    assert by_type["Available"].message == "serving: decode 1/2, gateway 1/1, render 1/1"
    progressing = by_type["Progressing"]
    assert (progressing.status, progressing.reason) == ("True", "RollingOut")
    # What each pod waits on, and since when.
    assert "decode pod m-decode-1: starting (loading the model) for 3m12s" in progressing.message
    assert (
        "prefill pod m-prefill-0: pulling the image or mounting volumes (ContainerCreating) "
        "for 2m00s" in progressing.message
    )


def test_without_a_ready_replica_of_a_pool_it_needs_it_is_not_available() -> None:
    ok = workload(1, 1)
    status = status_of({"prefill": workload(1, 0), "decode": workload(1, 0), "render": ok,
                        "gateway": ok}, [])  # fmt: skip
    available = conditions(status)["Available"]
    assert (available.status, available.reason) == ("False", "NoReadyReplicas")
    assert available.message == "no ready replica in decode"
    # In routing mode Disaggregated every request needs prefill too.
    body = resource(prefill={}, gateway={"routing": {"mode": "Disaggregated"}})
    strict = status_of({"prefill": workload(1, 0), "decode": ok, "render": ok, "gateway": ok},
                       [], parse_resource(body))  # fmt: skip
    assert conditions(strict)["Available"].message == "no ready replica in prefill"


def test_a_pod_past_the_progress_deadline_is_named_and_the_model_degraded() -> None:
    ok = workload(1, 1)
    stuck = pod("m-decode-0", "decode", created="2026-12-05T11:50:00Z",
                containerStatuses=[{"restartCount": 2,
                                    "state": {"running": {"startedAt": "2026-12-05T12:20:00Z"}}}],
                conditions=[{"type": "Ready", "status": "False"}])  # fmt: skip
    status = status_of({"prefill": ok, "decode": workload(1, 0), "render": ok, "gateway": ok},
                       [stuck])  # fmt: skip
    by_type = conditions(status)
    assert (by_type["Progressing"].status, by_type["Progressing"].reason) == (
        "False", "ProgressDeadlineExceeded")  # fmt: skip
    assert status.phase == "Degraded"
    assert by_type["Degraded"].reason == "ProgressDeadlineExceeded"
    assert by_type["Degraded"].message == (
        "not Ready 30m00s after creation (spec.progressDeadlineSeconds): decode pod m-decode-0: "
        "starting (loading the model), 2 restarts for 10m00s"
    )
    # A longer deadline: still progressing.
    patient = parse_resource(resource(prefill={}, progressDeadlineSeconds=3600))
    later = status_of({"prefill": ok, "decode": workload(1, 0), "render": ok, "gateway": ok},
                      [stuck], patient)  # fmt: skip
    assert conditions(later)["Progressing"].reason == "RollingOut"


def test_a_pod_of_a_group_is_named_with_its_group_worker_and_ranks() -> None:
    worker = pod("m-decode-1-1", "decode", created="2026-12-05T12:29:00Z")
    worker["metadata"]["labels"].update({GROUP_INDEX_LABEL: "1", WORKER_INDEX_LABEL: "1"})
    worker["spec"]["containers"] = [{"name": "vllm", "args": [
        "m", "--data-parallel-size", "16", "--nnodes", "4", "--node-rank", "$(LWS_WORKER_INDEX)",
    ]}]  # fmt: skip
    del worker["spec"]["nodeName"]
    ok = workload(1, 1)
    status = status_of({"prefill": ok, "decode": workload(2, 1), "render": ok, "gateway": ok},
                       [worker])  # fmt: skip
    assert ("decode pod m-decode-1-1 (group 1, worker 1: DP ranks 4-7): waiting to be scheduled "
            "for 1m00s") in conditions(status)["Progressing"].message  # fmt: skip


def test_a_multi_node_pool_counts_and_prints_whole_groups() -> None:
    """`kubectl get dm` prints a multi-node pool in groups; a group with a pod not Ready is not
    counted, whatever LWS's own readyReplicas says."""
    lws = {
        "kind": "LeaderWorkerSet", "metadata": {"name": "m-decode", "generation": 1},
        "spec": {"replicas": 2}, "status": {"readyReplicas": 2, "updatedReplicas": 2},
    }  # fmt: skip

    def member(name: str, group: str, ready: bool) -> dict[str, Any]:
        return {"metadata": {
            "name": name, "annotations": {LWS_SIZE_ANNOTATION: "2"},
            "labels": {LWS_NAME_LABEL: "m-decode", GROUP_INDEX_LABEL: group},
        }, "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}  # fmt: skip

    pods = [member("m-decode-0", "0", True), member("m-decode-0-1", "0", True),
            member("m-decode-1", "1", True), member("m-decode-1-1", "1", False)]  # fmt: skip
    counts, rolled_out = pool_status([lws], pods)
    assert (counts.ready, counts.desired, counts.summary) == (1, 2, "1/2 groups")
    assert not rolled_out
    assert pool_status([workload(2, 2)])[0].summary == "2/2"


def test_a_group_whose_leader_took_a_domain_without_room_is_named_with_the_fix() -> None:
    leader = pod("m-decode-0", "decode", created="2026-12-05T12:29:00Z")
    worker = pod("m-decode-0-1", "decode", created="2026-12-05T12:29:00Z", conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available: 4 node(s) didn't match pod affinity rules."},
    ])  # fmt: skip
    del worker["spec"]["nodeName"]
    for member, index in ((leader, "0"), (worker, "1")):
        member["metadata"]["labels"].update(
            {LWS_NAME_LABEL: "m-decode", GROUP_INDEX_LABEL: "0", WORKER_INDEX_LABEL: index}
        )
    placement = DM.spec.placement.model_copy(update={"gpu_products": ["NVIDIA-GB200"]})
    gb200 = DM.model_copy(update={"spec": DM.spec.model_copy(update={"placement": placement})})
    assert gb200.spec.placement.group_topology_key == "nvidia.com/gpu.clique"
    assert placement_condition(DM, [leader, worker])[2].count("Group leaders") == 0  # no domain
    status, reason, message = placement_condition(gb200, [leader, worker])
    assert (status, reason) == (False, "Unschedulable")
    assert message.startswith("decode pod m-decode-0-1: 0/4 nodes are available")
    assert "Group leaders bound where their workers do not fit: m-decode-0 on h200-0" in message
    assert "delete the leader pod so the group is recreated and placed anew" in message
    # A pool of single-node replicas has no group to name.
    del worker["metadata"]["labels"][LWS_NAME_LABEL]
    assert "Group leaders" not in placement_condition(gb200, [leader, worker])[2]
