"""Controller logic that needs no API server: deciding what to write, parity drift, status."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import pytest

from pdserve.api import parse_resource
from pdserve.api.status import DisaggregatedModelStatus
from pdserve.builders import Component, build_all
from pdserve.controller.children import key_of, owned
from pdserve.controller.diff import APPLIED_HASH_ANNOTATION, contains, is_current, merge_patch
from pdserve.controller.drift import parity_drift
from pdserve.controller.health import HealthVerdict
from pdserve.controller.reconcile import Outcome, transition_events
from pdserve.controller.settings import add_arguments, from_arguments
from pdserve.controller.status import Observation, compute_status

BODY: dict[str, Any] = {
    "apiVersion": "pdserve.io/v1alpha1",
    "kind": "DisaggregatedModel",
    "metadata": {"name": "m", "namespace": "ns", "uid": "uid-1", "generation": 3},
    "spec": {"model": {"name": "org/model"}, "prefill": {}},
}
DM = parse_resource(BODY)


def desired() -> list[dict[str, Any]]:
    return [owned(BODY, obj) for obj in build_all(DM)]


def server_view(obj: dict[str, Any]) -> dict[str, Any]:
    """What the API server returns: our fields plus defaults and bookkeeping."""
    live = copy.deepcopy(obj)
    live["metadata"]["uid"] = "child-uid"
    live["metadata"]["resourceVersion"] = "7"
    live.setdefault("status", {})["observedGeneration"] = 1
    if live["kind"] == "StatefulSet":
        container = live["spec"]["template"]["spec"]["containers"][0]
        container["terminationMessagePath"] = "/dev/termination-log"
        container["readinessProbe"]["successThreshold"] = 1
        live["spec"]["revisionHistoryLimit"] = 10
    return live


def test_a_child_with_server_defaults_is_current() -> None:
    for obj in desired():
        assert is_current(server_view(obj), obj), obj["kind"]


def test_a_hand_edited_field_is_not_current() -> None:
    sts = next(o for o in desired() if o["kind"] == "StatefulSet")
    live = server_view(sts)
    live["spec"]["replicas"] = 5
    assert not is_current(live, sts)


def test_a_field_pdserve_stopped_setting_changes_the_applied_hash() -> None:
    sts = next(o for o in desired() if o["kind"] == "StatefulSet")
    live = server_view(sts)
    live["metadata"]["annotations"][APPLIED_HASH_ANNOTATION] = "older"
    assert not is_current(live, sts)
    assert not is_current(None, sts)


def test_lists_must_match_item_by_item_and_absent_equals_empty() -> None:
    assert contains({"a": [{"x": 1, "y": 2}]}, {"a": [{"x": 1}]})
    assert not contains({"a": [{"x": 1}, {"x": 2}]}, {"a": [{"x": 1}]})
    assert contains({}, {"env": [], "labels": {}})
    assert not contains({}, {"env": [{"name": "A"}]})


def test_merge_patch_nulls_removed_keys() -> None:
    assert merge_patch({"a": 1, "b": {"c": 1, "d": 2}}, {"b": {"c": 1}}) == {
        "a": None, "b": {"d": None},
    }  # fmt: skip


def test_parity_drift_names_the_pool_and_the_flag() -> None:
    want = desired()
    live = {key_of(o): server_view(o) for o in want}
    assert parity_drift(want, live) == []
    decode = next(o for o in want if key_of(o)[1:] == ("StatefulSet", "m-decode"))
    args = live[key_of(decode)]["spec"]["template"]["spec"]["containers"][0]["args"]
    index = args.index("--block-size")
    args[index : index + 2] = ["--block-size=32"]
    [message] = parity_drift(want, live)
    assert message == "decode StatefulSet/m-decode: --block-size is '32', spec says '16'"


def workload(replicas: int, ready: int, updated: int | None = None) -> dict[str, Any]:
    return {"metadata": {"generation": 1}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": 1, "readyReplicas": ready,
                       "updatedReplicas": replicas if updated is None else updated}}  # fmt: skip


def status_for(**pools: dict[str, Any]) -> DisaggregatedModelStatus:
    seen = Observation(workloads={Component(k): [v] for k, v in pools.items()})
    return compute_status(DM, seen, None, generation=3, parity="abc", now="2026-01-01T00:00:00Z")


def test_ready_when_every_pool_is_rolled_out() -> None:
    ok = workload(1, 1)
    status = status_for(prefill=ok, decode=ok, render=ok, gateway=workload(2, 2))
    by_type = {c.type: c for c in status.conditions}
    assert status.phase == "Ready"
    assert by_type["Ready"].status == "True"
    assert by_type["Progressing"].status == "False"
    assert status.pools.gateway.summary == "2/2"
    assert status.observed_generation == 3


def test_progressing_names_the_pools_it_waits_for() -> None:
    ok = workload(1, 1)
    status = status_for(prefill=ok, decode=workload(2, 1), render=ok, gateway=ok)
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert status.phase == "Progressing"
    assert ready.message == "waiting for decode 1/2 ready"


UNSCHEDULABLE = "0/6 nodes are available: insufficient nvidia.com/gpu"


def test_unschedulable_pods_make_it_degraded_with_the_scheduler_message() -> None:
    pod = {"metadata": {"name": "m-decode-0", "labels": {"app.kubernetes.io/component": "decode"}},
           "status": {"conditions": [{"type": "PodScheduled", "status": "False",
                                      "reason": "Unschedulable",
                                      "message": UNSCHEDULABLE}]}}  # fmt: skip
    seen = Observation(workloads={Component.decode: [workload(1, 0)]}, pods=[pod])
    status = compute_status(DM, seen, None, generation=3, parity="abc", now="t")
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert status.phase == "Degraded"
    assert degraded.message == (
        "decode pod m-decode-0: Unschedulable: 0/6 nodes are available: insufficient nvidia.com/gpu"
    )


def engine_pod(name: str, pool: str, slice_index: int, node: str | None) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "metadata": {"name": name, "labels": {
            "app.kubernetes.io/component": pool, "pdserve.io/slice": str(slice_index)}},
        "spec": {"nodeName": node} if node else {}, "status": {},
    }  # fmt: skip
    if node is None:
        pod["status"]["conditions"] = [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": UNSCHEDULABLE}]  # fmt: skip
    return pod


def placement_of(pods: list[dict[str, Any]], dm: Any = DM) -> Any:
    seen = Observation(workloads={Component.decode: [workload(1, 1)]}, pods=pods)
    status = compute_status(dm, seen, None, generation=3, parity="abc", now="t")
    return next(c for c in status.conditions if c.type == "Placement")


def test_placement_says_where_each_slice_landed() -> None:
    placed = placement_of([
        engine_pod("m-prefill-s0-0", "prefill", 0, "gpu-a"),
        engine_pod("m-decode-s0-0", "decode", 0, "gpu-b"),
        engine_pod("m-prefill-s1-0", "prefill", 1, "gpu-c"),
        engine_pod("m-decode-s1-0", "decode", 1, "gpu-c"),
    ])  # fmt: skip
    assert (placed.status, placed.reason) == ("True", "Placed")
    assert placed.message == "slice 0 on gpu-a, gpu-b; slice 1 on gpu-c"


def test_placement_false_quotes_the_scheduler_and_names_the_domain_rule() -> None:
    body = copy.deepcopy(BODY)
    body["spec"]["placement"] = {"slices": 2, "domain": {"topologyKey": "nvidia.com/gpu.clique"}}
    dm = parse_resource(body)
    placed = placement_of(
        [engine_pod("m-decode-s1-0", "decode", 1, None),
         engine_pod("m-decode-s0-0", "decode", 0, "gpu-a")], dm,
    )  # fmt: skip
    assert (placed.status, placed.reason) == ("False", "Unschedulable")
    assert placed.message == (
        f"decode pod m-decode-s1-0: {UNSCHEDULABLE} (placement.domain nvidia.com/gpu.clique is "
        "Required: every pod of a slice must fit in one domain)"
    )


def test_placement_is_unknown_while_the_scheduler_works() -> None:
    pod = engine_pod("m-decode-0", "decode", 0, "x")
    pod["spec"] = {}
    assert (placement_of([pod]).status, placement_of([]).status) == ("Unknown", "Unknown")


def test_sliced_pools_are_summed_and_ready_only_when_every_slice_is() -> None:
    seen = Observation(workloads={
        Component.prefill: [workload(1, 1), workload(1, 1)],
        Component.decode: [workload(2, 2), workload(2, 1)],
        Component.render: [workload(1, 1)], Component.gateway: [workload(1, 1)],
    })  # fmt: skip
    status = compute_status(DM, seen, None, generation=3, parity="abc", now="t")
    assert status.pools.prefill is not None
    assert status.pools.prefill.summary == "2/2"
    assert status.pools.decode.summary == "3/4"
    assert status.phase == "Progressing"


def test_transition_time_moves_only_when_a_condition_flips() -> None:
    ok = workload(1, 1)
    first = status_for(prefill=ok, decode=ok, render=ok, gateway=ok)
    seen = Observation(
        workloads={Component(k): [ok] for k in ("prefill", "decode", "render", "gateway")}
    )
    again = compute_status(DM, seen, first, generation=3, parity="abc", now="later")
    assert again == first
    outcome = Outcome()
    transition_events(first, again, outcome)
    assert outcome.events == []


def test_invalid_spec_is_failed_with_the_problem_as_message() -> None:
    seen = Observation(
        problems=["spec.decode.replicas: Input should be greater than or equal to 0"]
    )
    status = compute_status(None, seen, None, generation=2, parity=None, now="t")
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert status.phase == "Failed"
    assert (ready.reason, ready.message) == ("InvalidSpec", seen.problems[0])


def parse_settings(argv: list[str], env: dict[str, str]) -> Any:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_arguments(parser.parse_args(argv), env)


def test_settings_come_from_flags_then_env_then_defaults() -> None:
    assert parse_settings([], {}).resync_seconds == 60
    env = {"PDSERVE_NAMESPACES": "b,a", "PDSERVE_RESYNC_SECONDS": "5"}
    settings = parse_settings([], env)
    assert (settings.namespaces, settings.resync_seconds) == (("a", "b"), 5.0)
    assert parse_settings(["-n", "x", "--resync-seconds", "9"], env).namespaces == ("x",)
    defaults = parse_settings([], {})
    assert (defaults.autoscale_seconds, defaults.metrics_port) == (15.0, None)
    scaling = parse_settings(["--metrics-port", "8081"], {"PDSERVE_AUTOSCALE_SECONDS": "0"})
    assert (scaling.autoscale_seconds, scaling.metrics_port) == (0.0, 8081)


@pytest.mark.parametrize(
    ("env", "message"),
    [({"PDSERVE_RESYNC_SECONDS": "soon"}, "PDSERVE_RESYNC_SECONDS='soon' is not a number"),
     ({"PDSERVE_LOG_FORMAT": "xml"}, "PDSERVE_LOG_FORMAT must be plain or json"),
     ({"PDSERVE_RESYNC_SECONDS": "0"}, "--resync-seconds must be > 0"),
     ({"PDSERVE_AUTOSCALE_SECONDS": "-1"}, "--autoscale-seconds must be >= 0"),
     ({"PDSERVE_METRICS_PORT": "http"}, "PDSERVE_METRICS_PORT='http' is not a port")],
)  # fmt: skip
def test_bad_settings_name_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_settings([], env)


def test_transport_healthy_carries_the_scrapers_verdict() -> None:
    def healthy(verdict: HealthVerdict | None) -> tuple[str, str]:
        seen = Observation(workloads={Component.decode: [workload(1, 1)]}, health=verdict)
        status = compute_status(DM, seen, None, generation=3, parity="abc", now="t")
        found = next(c for c in status.conditions if c.type == "TransportHealthy")
        return found.status, found.reason

    assert healthy(None) == ("Unknown", "NotMeasured")
    assert healthy(HealthVerdict(False, "SlowTransfers", "x")) == ("False", "SlowTransfers")
