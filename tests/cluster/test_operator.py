"""The operator against the real control plane: children, scheduling, status, updates, pruning,
drift repair, autoscaler-owned replicas, zero-write resyncs, invalid specs, deletion."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from devtools.clitools import Kubectl
from devtools.localplane import OPERATOR_USER, ControlPlane, ControlPlaneError, wait_until
from devtools.operator_proc import RunningOperator
from devtools.resources import (
    SMALL_PD_SPEC,
    apply_dm,
    conditions,
    dm_url,
    events_for,
    get,
    wait_ready,
)
from pdserve.kube.client import Kube
from pdserve.kube.credentials import load_credentials
from pdserve.kube.events import post_event

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("dm_crd")]

RESYNC_SECONDS = 2
H200_NODES = {"h200-0", "h200-1"}


# Engines pinned to H200 nodes by placement; one replica per pool keeps the tests quick.
SPEC: dict[str, Any] = {
    **SMALL_PD_SPEC,
    "placement": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}},
}


@pytest.mark.usefixtures("operator")
def test_create_builds_every_child_schedules_on_gpus_and_reports_ready(
    control_plane: ControlPlane, http_api: httpx.Client, namespace: str, kubectl: Kubectl
) -> None:
    phases: list[str] = []
    with (
        control_plane.http() as watcher,
        watcher.stream(
            "GET", dm_url(namespace), params={"watch": "1", "timeoutSeconds": "90"}, timeout=100
        ) as stream,
    ):
        apply_dm(http_api, namespace, "qwen", SPEC)
        for line in stream.iter_lines():
            status = json.loads(line)["object"].get("status") or {}
            if status.get("phase") and (not phases or phases[-1] != status["phase"]):
                phases.append(status["phase"])
            if status.get("phase") == "Ready":
                break
    assert phases[0] == "Progressing"
    assert phases[-1] == "Ready"

    waited = kubectl("wait", "-n", namespace, "--for=condition=Ready", "dm/qwen", "--timeout=60s")
    assert waited.returncode == 0, waited.stderr
    table = kubectl("get", "-n", namespace, "dm", check=True).stdout.split()
    assert table[:7] == ["NAME", "READY", "PREFILL", "DECODE", "RENDER", "PARITY", "AGE"]
    assert table[7:13] == ["qwen", "True", "1/1", "1/1", "1/1", "True"]

    dm = get(http_api, dm_url(namespace, "qwen"))
    assert dm is not None
    uid = dm["metadata"]["uid"]
    for path in (f"/apis/apps/v1/namespaces/{namespace}/statefulsets/qwen-prefill",
                 f"/apis/apps/v1/namespaces/{namespace}/statefulsets/qwen-decode",
                 f"/apis/apps/v1/namespaces/{namespace}/deployments/qwen-render",
                 f"/apis/apps/v1/namespaces/{namespace}/deployments/qwen-gateway",
                 f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/qwen-render",
                 f"/api/v1/namespaces/{namespace}/configmaps/qwen-gateway",
                 f"/api/v1/namespaces/{namespace}/services/qwen-gateway"):  # fmt: skip
        child = get(http_api, path)
        assert child is not None, path
        [owner] = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "DisaggregatedModel",
            uid,
            True,
        )

    pods = http_api.get(f"/api/v1/namespaces/{namespace}/pods").json()["items"]
    engines = [p for p in pods if p["metadata"]["labels"]["app.kubernetes.io/component"]
               in ("prefill", "decode")]  # fmt: skip
    assert len(engines) == 2
    assert {p["spec"]["nodeName"] for p in engines} <= H200_NODES
    # The transport preflight (kvTransfer.verify defaults to Warn) probes on the engines' nodes.
    probes = [p for p in pods if p["metadata"]["labels"]["app.kubernetes.io/component"]
              == "preflight"]  # fmt: skip
    assert {p["spec"].get("nodeName") for p in probes} <= {
        p["spec"]["nodeName"] for p in engines
    } | {None}
    cpu_pods = [p for p in pods if p not in engines and p not in probes]
    assert {p["spec"]["nodeName"] for p in cpu_pods} <= {"cpu-0", "cpu-1"}  # kept off GPU nodes
    hashes = {p["metadata"]["annotations"]["pdserve.io/parity-hash"] for p in engines + cpu_pods}
    assert hashes == {dm["status"]["parityHash"]}
    assert dm["status"]["endpoint"] == f"http://qwen-gateway.{namespace}.svc:8000/v1"


@pytest.mark.usefixtures("operator")
def test_pod_overrides_reach_every_pools_scheduled_pods_and_the_gateway_service(
    http_api: httpx.Client, namespace: str
) -> None:
    """A PriorityClass (the API server resolves it into the pods' priority), team labels that a
    topology spread selects, a volume mounted into the main container and a sidecar beside it,
    on each pool; the gateway Service's annotation. The pods are bound all the same."""
    priority = f"{namespace}-inference"
    classes = "/apis/scheduling.k8s.io/v1/priorityclasses"
    http_api.post(
        classes, json={"metadata": {"name": priority}, "value": 100000}
    ).raise_for_status()
    overrides: dict[str, Any] = {
        "priorityClassName": priority,
        "labels": {"team": "search"},
        "volumes": [{"name": "store-ca", "emptyDir": {}}],
        "volumeMounts": [{"name": "store-ca", "mountPath": "/etc/ssl/store", "readOnly": True}],
        "sidecars": [{"name": "log-shipper", "image": "busybox:1.37"}],
        "topologySpreadConstraints": [{
            "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"team": "search"}},
        }],
    }  # fmt: skip
    annotation = {"service.beta.kubernetes.io/aws-load-balancer-internal": "true"}
    spec = {
        **SPEC,
        "prefill": {"replicas": 1, "podOverrides": overrides},
        "decode": {"replicas": 1, "podOverrides": overrides},
        "render": {**SPEC["render"], "podOverrides": overrides},
        "gateway": {"replicas": 1, "podOverrides": overrides, "serviceAnnotations": annotation},
    }
    try:
        apply_dm(http_api, namespace, "qwen", spec)
        wait_ready(http_api, namespace, "qwen")
        pods = http_api.get(f"/api/v1/namespaces/{namespace}/pods").json()["items"]
        by_pool = {p["metadata"]["labels"]["app.kubernetes.io/component"]: p for p in pods}
        for pool in ("prefill", "decode", "render", "gateway"):
            pod = by_pool[pool]
            assert pod["spec"]["priorityClassName"] == priority, pool
            assert pod["spec"]["priority"] == 100000, pool  # resolved by the API server
            assert pod["metadata"]["labels"]["team"] == "search", pool
            assert pod["spec"]["nodeName"], pool
            main, sidecar = pod["spec"]["containers"]
            assert sidecar["name"] == "log-shipper", pool
            assert overrides["volumeMounts"][0] in main["volumeMounts"], pool
            assert (
                pod["spec"]["topologySpreadConstraints"] == (overrides["topologySpreadConstraints"])
            ), pool
        service = get(http_api, f"/api/v1/namespaces/{namespace}/services/qwen-gateway")
        assert service is not None
        assert annotation.items() <= service["metadata"]["annotations"].items()
    finally:
        http_api.delete(f"{classes}/{priority}")


@pytest.mark.usefixtures("operator")
def test_spec_changes_are_applied_and_dropped_pools_pruned(
    http_api: httpx.Client, namespace: str
) -> None:
    apply_dm(http_api, namespace, "qwen", SPEC)
    wait_ready(http_api, namespace, "qwen")

    apply_dm(http_api, namespace, "qwen", {**SPEC, "decode": {"replicas": 2}})
    dm = wait_ready(http_api, namespace, "qwen")
    assert dm["status"]["pools"]["decode"]["summary"] == "2/2"
    sts = get(http_api, f"/apis/apps/v1/namespaces/{namespace}/statefulsets/qwen-decode")
    assert sts is not None
    assert sts["spec"]["replicas"] == 2

    # Keep decode at 2: scaling a Parallel StatefulSet down while its template changes makes
    # kube-controller-manager 1.37 compute status.currentReplicas = -1 and retry for minutes
    # (seen with kwok's instant pod lifecycle); that is not what this test is about.
    apply_dm(
        http_api,
        namespace,
        "qwen",
        {**SPEC, "decode": {"replicas": 2}, "render": {"enabled": False}},
    )
    render_paths = [
        f"/apis/apps/v1/namespaces/{namespace}/deployments/qwen-render",
        f"/api/v1/namespaces/{namespace}/services/qwen-render",
        f"/apis/autoscaling/v2/namespaces/{namespace}/horizontalpodautoscalers/qwen-render",
        f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/qwen-render",
    ]
    wait_until("the render pool to be pruned",
               lambda: all(get(http_api, p) is None for p in render_paths), timeout=60)  # fmt: skip
    dm = wait_ready(http_api, namespace, "qwen")
    assert "render" not in dm["status"]["pools"]
    engine = get(http_api, f"/apis/apps/v1/namespaces/{namespace}/statefulsets/qwen-decode")
    assert engine is not None
    args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--tokens-only" not in args  # engines speak OpenAI themselves now
    assert "--tool-call-parser" in args


def test_hand_edited_parity_flag_is_reported_and_repaired(
    operator: RunningOperator, http_api: httpx.Client, namespace: str
) -> None:
    apply_dm(http_api, namespace, "qwen", SPEC)
    wait_ready(http_api, namespace, "qwen")
    path = f"/apis/apps/v1/namespaces/{namespace}/statefulsets/qwen-prefill"
    sts = get(http_api, path)
    assert sts is not None
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    index = args.index("--block-size") + 1
    edit = [{"op": "replace", "path": f"/spec/template/spec/containers/0/args/{index}",
             "value": "32"}]  # fmt: skip
    json_patch = {"Content-Type": "application/json-patch+json"}
    http_api.patch(path, json=edit, headers=json_patch).raise_for_status()

    def repaired() -> bool:
        live = get(http_api, path)
        return (
            live is not None
            and live["spec"]["template"]["spec"]["containers"][0]["args"][index] == "16"
        )

    wait_until("the operator to repair --block-size", repaired, timeout=30)

    def drift_events() -> list[dict[str, Any]]:
        return [e for e in events_for(http_api, namespace, "qwen") if e["reason"] == "ParityDrift"]

    # The event is posted when the repairing pass ends, even if a later step of it failed.
    try:
        wait_until("a ParityDrift event", lambda: bool(drift_events()), timeout=10)
    except ControlPlaneError as error:
        story = operator.story(namespace, "qwen")
        raise AssertionError(f"{error}; the operator on it:\n{story}") from None
    drift = drift_events()
    assert "--block-size is '32', spec says '16'" in drift[0]["message"]
    assert drift[0]["type"] == "Warning"


@pytest.mark.usefixtures("operator")
def test_resync_of_a_settled_resource_writes_nothing_and_leaves_hpa_replicas_alone(
    control_plane: ControlPlane, operator: RunningOperator, http_api: httpx.Client, namespace: str
) -> None:
    apply_dm(http_api, namespace, "qwen", SPEC)
    wait_ready(http_api, namespace, "qwen")
    # The HPA (simulated here) scales render; the operator must not fight it.
    scale = f"/apis/apps/v1/namespaces/{namespace}/deployments/qwen-render/scale"
    merge_patch = {"Content-Type": "application/merge-patch+json"}
    http_api.patch(scale, json={"spec": {"replicas": 3}}, headers=merge_patch).raise_for_status()
    wait_ready(http_api, namespace, "qwen")  # status catches up to 3/3 render replicas

    def writes() -> list[dict[str, Any]]:
        return [e for e in control_plane.audit_events(user=OPERATOR_USER)
                if e["objectRef"].get("namespace") == namespace]  # fmt: skip

    def reads() -> list[dict[str, Any]]:
        """Gets and lists in the namespace (its watches span the cluster, opened once)."""
        seen = control_plane.audit_events(user=OPERATOR_USER, writes_only=False)
        return [e for e in seen if e.get("objectRef", {}).get("namespace") == namespace
                and e["verb"] in ("get", "list")]  # fmt: skip

    def passes() -> int:
        return operator.in_sync_count(namespace, "qwen")

    wait_until("status to settle", lambda: _settled(http_api, namespace), timeout=60)
    # The pass that wrote the settled status posts its events after that write: count writes
    # from the next pass on, when the settling pass has ended (one worker per model).
    settling = passes()
    wait_until("the settling pass to end", lambda: passes() > settling, timeout=10 * RESYNC_SECONDS)
    before, read_before, seen = len(writes()), len(reads()), passes()
    wait_until("two resync passes", lambda: passes() >= seen + 2, timeout=10 * RESYNC_SECONDS)
    late = [f"{e['verb']} {e['requestURI']}" for e in writes()[before:]]
    assert late == [], f"writes by resyncs: {late}; the operator on it:\n" + operator.story(
        namespace, "qwen"
    )
    # The passes read the model, its children, pods and the gateways' Events from the
    # operator's watches: a settled resync asks the API server nothing.
    late_reads = [f"{e['verb']} {e['requestURI']}" for e in reads()[read_before:]]
    assert late_reads == [], f"reads by resyncs: {late_reads}"
    render = get(http_api, f"/apis/apps/v1/namespaces/{namespace}/deployments/qwen-render")
    assert render is not None
    assert render["spec"]["replicas"] == 3


def _settled(http: httpx.Client, namespace: str) -> bool:
    """Render counted at 3/3, the model Ready again (it dips while the new pods start), and the
    transport health scraper's first verdict written: it scrapes the decode pods every 15 s on
    its own clock (nothing answers on kwok's pod IPs: MetricsUnreachable), and that first
    verdict is a status write of its own, not a resync's, whenever it comes."""
    dm = get(http, dm_url(namespace, "qwen"))
    return bool(
        dm
        and dm["status"]["pools"].get("render", {}).get("summary") == "3/3"
        and conditions(dm).get("Ready", {}).get("status") == "True"
        and conditions(dm).get("TransportHealthy", {}).get("reason") not in (None, "NotMeasured")
    )


@pytest.mark.usefixtures("operator")
def test_spec_the_schema_cannot_catch_is_reported_in_status_and_events(
    http_api: httpx.Client, namespace: str
) -> None:
    spec = {**SPEC, "decode": {"extraArgs": ["--block-size", "32"]}}
    apply_dm(http_api, namespace, "bad", spec)

    def failed() -> bool:
        dm = get(http_api, dm_url(namespace, "bad"))
        return ((dm or {}).get("status") or {}).get("phase") == "Failed"

    wait_until("status phase Failed", failed, timeout=30)
    dm = get(http_api, dm_url(namespace, "bad"))
    ready = conditions(dm)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "spec.decode.extraArgs[0] sets parity flag --block-size" in ready["message"]
    # The Event is posted when the pass that wrote the status ends: a moment later.
    wait_until(
        "an InvalidSpec Event",
        lambda: "InvalidSpec" in [e["reason"] for e in events_for(http_api, namespace, "bad")],
        timeout=10,
    )
    assert get(http_api, f"/apis/apps/v1/namespaces/{namespace}/statefulsets/bad-decode") is None


@pytest.mark.usefixtures("operator")
def test_deleting_the_resource_garbage_collects_its_children(
    http_api: httpx.Client, namespace: str
) -> None:
    apply_dm(http_api, namespace, "qwen", SPEC)
    wait_ready(http_api, namespace, "qwen")
    http_api.delete(dm_url(namespace, "qwen")).raise_for_status()
    children = [f"/apis/apps/v1/namespaces/{namespace}/statefulsets/qwen-decode",
                f"/apis/apps/v1/namespaces/{namespace}/deployments/qwen-gateway",
                f"/api/v1/namespaces/{namespace}/configmaps/qwen-gateway"]  # fmt: skip
    wait_until("children to be garbage-collected",
               lambda: all(get(http_api, p) is None for p in children), timeout=60)  # fmt: skip


def test_an_event_told_again_counts_one_more_instead_of_a_new_object(
    control_plane: ControlPlane, http_api: httpx.Client, namespace: str
) -> None:
    """As client-go's correlator does: a resync telling the same drift every minute leaves one
    Event whose count grows, not one object per minute in etcd."""
    made = http_api.post(f"/api/v1/namespaces/{namespace}/configmaps",
                         json={"metadata": {"name": "told"}})  # fmt: skip
    made.raise_for_status()
    body = {"apiVersion": "v1", "kind": "ConfigMap", **made.json()}

    async def tell(message: str) -> None:
        kube = Kube(load_credentials(str(control_plane.kubeconfig())))
        try:
            await post_event(kube, body, "Warning", "ParityDrift", message, reporter="pdserve-test")
        finally:
            await kube.close()

    asyncio.run(tell("repairing: decode --max-model-len 4096 -> 8192"))
    asyncio.run(tell("repairing: decode --max-model-len 4096 -> 8192"))
    asyncio.run(tell("repairing: prefill --block-size 32 -> 16"))
    listed = http_api.get(f"/api/v1/namespaces/{namespace}/events",
                          params={"fieldSelector": "involvedObject.name=told"})  # fmt: skip
    events = listed.json()["items"]
    counts = sorted((e["message"], e["count"]) for e in events)
    assert counts == [
        ("repairing: decode --max-model-len 4096 -> 8192", 2),
        ("repairing: prefill --block-size 32 -> 16", 1),
    ]
