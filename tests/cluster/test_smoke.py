"""Proof that the local control plane is a real one: schema + CEL validation, controllers,
scheduler placement on fake GPU nodes, garbage collection, server-side apply, audit log; and
that its fake nodes finish deletions as a kubelet does."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from devtools.clitools import Kubectl
from devtools.localplane import OPERATOR_USER, ControlPlane, wait_until
from devtools.nodes import GPU_PRODUCT_LABEL, GPU_RESOURCE, RDMA_RESOURCE, cpu_node
from devtools.planecommands import KWOK_NODE_ANNOTATION
from devtools.pod_finisher import PodFinisher
from tests.support.plane_scopes import nodes_held

pytestmark = pytest.mark.cluster

APPLY = {"Content-Type": "application/apply-patch+yaml"}
WIDGETS = "/apis/smoke.pdserve.io/v1/namespaces/{ns}/widgets"


@pytest.fixture(scope="module")
def widget_crd(control_plane: ControlPlane) -> Iterator[None]:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.smoke.pdserve.io"},
        "spec": {
            "group": "smoke.pdserve.io",
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "x-kubernetes-validations": [
                                        {
                                            "rule": "self.maxReplicas >= self.minReplicas",
                                            "message": "maxReplicas must be >= minReplicas",
                                            "fieldPath": ".maxReplicas",
                                        }
                                    ],
                                    "properties": {
                                        "minReplicas": {"type": "integer", "minimum": 0},
                                        "maxReplicas": {"type": "integer", "minimum": 0},
                                        "mode": {"type": "string", "enum": ["Auto", "Manual"]},
                                    },
                                    "required": ["minReplicas", "maxReplicas"],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    with control_plane.http() as http:
        path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        http.post(path, json=crd).raise_for_status()

        def established() -> bool:
            status = http.get(f"{path}/widgets.smoke.pdserve.io").json().get("status", {})
            return any(
                c["type"] == "Established" and c["status"] == "True"
                for c in status.get("conditions", [])
            )

        wait_until("the Widget CRD to be Established", established, timeout=30)
        yield
        http.delete(f"{path}/widgets.smoke.pdserve.io")


def widget(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "smoke.pdserve.io/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": spec,
    }


@pytest.mark.usefixtures("widget_crd")
def test_api_server_enforces_schema_and_cel_rules_naming_the_field(
    http_api: httpx.Client, namespace: str
) -> None:
    url = WIDGETS.format(ns=namespace)
    ok = http_api.post(url, json=widget("good", minReplicas=1, maxReplicas=3, mode="Auto"))
    assert ok.status_code == 201, ok.text

    cel = http_api.post(url, json=widget("inverted", minReplicas=5, maxReplicas=2))
    assert cel.status_code == 422
    causes = rejected_fields(cel)
    assert list(causes) == ["spec.maxReplicas"]
    assert causes["spec.maxReplicas"].endswith("maxReplicas must be >= minReplicas")

    enum = http_api.post(url, json=widget("bad-mode", minReplicas=0, maxReplicas=1, mode="Fast"))
    assert enum.status_code == 422
    causes = rejected_fields(enum)
    assert list(causes) == ["spec.mode"]
    assert 'supported values: "Auto", "Manual"' in causes["spec.mode"]

    bound = http_api.post(url, json=widget("negative", minReplicas=-1, maxReplicas=1))
    assert bound.status_code == 422
    causes = rejected_fields(bound)
    assert list(causes) == ["spec.minReplicas"]
    assert "greater than or equal to 0" in causes["spec.minReplicas"]


def rejected_fields(response: httpx.Response) -> dict[str, str]:
    """field -> message for each field-level cause of an API server 422 Status (the generic
    'some validation rules were not checked' cause names no field and is left out)."""
    causes = response.json()["details"]["causes"]
    return {c["field"]: c["message"] for c in causes if c.get("field") not in (None, "<nil>")}


def test_deployment_pods_are_created_and_bound_to_a_matching_gpu_node(
    apps_v1: Any, core_v1: Any, namespace: str
) -> None:
    labels = {"app": "gpu-smoke"}
    deployment: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "gpu-smoke"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {GPU_PRODUCT_LABEL: "NVIDIA-H200"},
                    "containers": [
                        {
                            "name": "engine",
                            "image": "vllm/vllm-openai:latest",
                            "resources": {"limits": {GPU_RESOURCE: "4", RDMA_RESOURCE: "1"}},
                        }
                    ],
                },
            },
        },
    }
    apps_v1.create_namespaced_deployment(namespace, deployment)

    def ready() -> bool:
        status = apps_v1.read_namespaced_deployment("gpu-smoke", namespace)
        return bool(status.status.ready_replicas == 2)

    wait_until("the Deployment to have 2 ready replicas", ready, timeout=90)
    pods = core_v1.list_namespaced_pod(namespace, label_selector="app=gpu-smoke").items
    assert len(pods) == 2
    for pod in pods:
        assert pod.metadata.owner_references[0].kind == "ReplicaSet"
        node = core_v1.read_node(pod.spec.node_name)
        assert node.metadata.labels[GPU_PRODUCT_LABEL] == "NVIDIA-H200"
        assert pod.status.phase == "Running"
    # Two pods of 4 GPUs each fit on one 8-GPU node or on two; either way only GPU nodes.
    assert {p.spec.node_name for p in pods} <= {"h200-0", "h200-1"}


def test_pod_asking_for_more_gpus_than_any_node_has_stays_pending(
    core_v1: Any, namespace: str
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "too-big"},
        "spec": {
            "containers": [
                {
                    "name": "engine",
                    "image": "vllm/vllm-openai:latest",
                    "resources": {"limits": {GPU_RESOURCE: "16"}},
                }
            ]
        },
    }
    core_v1.create_namespaced_pod(namespace, pod)

    def failed_scheduling_event() -> bool:
        events = core_v1.list_namespaced_event(
            namespace, field_selector="involvedObject.name=too-big"
        ).items
        return any(e.reason == "FailedScheduling" for e in events)

    wait_until("a FailedScheduling event", failed_scheduling_event, timeout=60)
    events = core_v1.list_namespaced_event(
        namespace, field_selector="involvedObject.name=too-big"
    ).items
    message = next(e.message for e in events if e.reason == "FailedScheduling")
    assert f"Insufficient {GPU_RESOURCE}" in message

    # The scheduler records the event and the pod's condition in two writes: wait for both.
    def unschedulable() -> bool:
        status = core_v1.read_namespaced_pod("too-big", namespace).status
        return any(
            (c.type, c.status, c.reason) == ("PodScheduled", "False", "Unschedulable")
            for c in status.conditions or []
        )

    wait_until("the pod's PodScheduled=False Unschedulable", unschedulable, timeout=30)
    assert core_v1.read_namespaced_pod("too-big", namespace).status.phase == "Pending"


def test_deleting_an_owner_garbage_collects_what_it_owns(
    http_api: httpx.Client, namespace: str
) -> None:
    base = f"/api/v1/namespaces/{namespace}/configmaps"
    owner = http_api.post(base, json={"metadata": {"name": "owner"}}).json()
    owner_ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    for name in ("child-a", "child-b"):
        response = http_api.post(
            base, json={"metadata": {"name": name, "ownerReferences": [owner_ref]}}
        )
        assert response.status_code == 201, response.text
    unrelated = http_api.post(base, json={"metadata": {"name": "unrelated"}})
    assert unrelated.status_code == 201

    http_api.request(
        "DELETE", f"{base}/owner", json={"propagationPolicy": "Background"}
    ).raise_for_status()

    def children_gone() -> bool:
        return all(
            http_api.get(f"{base}/{name}").status_code == 404 for name in ("child-a", "child-b")
        )

    wait_until("the garbage collector to delete the owned ConfigMaps", children_gone, timeout=60)
    assert http_api.get(f"{base}/unrelated").status_code == 200


def test_server_side_apply_tracks_field_managers_and_detects_conflicts(
    control_plane: ControlPlane, namespace: str
) -> None:
    name = f"ssa-{secrets.token_hex(3)}"
    url = f"/api/v1/namespaces/{namespace}/configmaps/{name}"
    manifest = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name},
        "data": {"model": "qwen", "blockSize": "16"},
    }
    body = yaml.safe_dump(manifest)

    with control_plane.http(OPERATOR_USER) as operator:
        first = operator.patch(url, params={"fieldManager": "pdserve"}, content=body, headers=APPLY)
        assert first.status_code == 201, first.text
        managers = {m["manager"]: m for m in first.json()["metadata"]["managedFields"]}
        assert managers["pdserve"]["operation"] == "Apply"
        assert set(managers["pdserve"]["fieldsV1"]["f:data"]) == {"f:model", "f:blockSize"}

        # Re-applying the same intent is a no-op: the object is not rewritten.
        again = operator.patch(url, params={"fieldManager": "pdserve"}, content=body, headers=APPLY)
        assert again.status_code == 200
        version = first.json()["metadata"]["resourceVersion"]
        assert again.json()["metadata"]["resourceVersion"] == version

    with control_plane.http() as admin:
        rival = yaml.safe_dump({**manifest, "data": {"blockSize": "32"}})
        conflict = admin.patch(
            url, params={"fieldManager": "someone-else"}, content=rival, headers=APPLY
        )
        assert conflict.status_code == 409
        assert "blockSize" in conflict.text
        assert "pdserve" in conflict.text

        forced = admin.patch(
            url,
            params={"fieldManager": "someone-else", "force": "true"},
            content=rival,
            headers=APPLY,
        )
        assert forced.status_code == 200
        assert forced.json()["data"]["blockSize"] == "32"

    # The audit log attributes the operator identity's writes to it: one apply created the
    # object; the no-op re-apply still reached the server as a patch request.
    def operator_patches() -> list[dict[str, Any]]:
        return [
            e
            for e in control_plane.audit_events(user=OPERATOR_USER)
            if e["verb"] == "patch" and e["objectRef"].get("name") == name
        ]

    wait_until(
        "two operator patches in the audit log", lambda: len(operator_patches()) == 2, timeout=30
    )
    assert {e["responseStatus"]["code"] for e in operator_patches()} == {200, 201}


def test_kubectl_of_the_same_release_waits_applies_and_reads(
    kubectl: Kubectl, namespace: str
) -> None:
    version = json.loads(kubectl("version", "-o", "json", check=True).stdout)
    assert version["clientVersion"]["minor"] == version["serverVersion"]["minor"] == "37"

    kubectl("wait", "--for=condition=Ready", "node/h200-0", "--timeout=30s", check=True)

    manifest = yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "from-kubectl", "namespace": namespace},
            "data": {"k": "v"},
        }
    )
    applied = kubectl("apply", "--server-side", "--field-manager=smoke", "-f", "-", stdin=manifest)
    assert applied.returncode == 0, applied.stderr
    assert "serverside-applied" in applied.stdout
    value = kubectl("get", "-n", namespace, "configmap/from-kubectl", "-o", "jsonpath={.data.k}")
    assert value.stdout == "v"


def test_a_deleted_pod_on_a_fake_node_goes_and_a_stale_deletion_spares_its_successor(
    http_api: httpx.Client, namespace: str
) -> None:
    """A kubelet removes a deleted pod with the pod's UID as the precondition
    (kubernetes/kubernetes#25224), so the old pod's deletion can never remove the pod a
    StatefulSet re-creates under the same name. The fake nodes do the same
    (devtools/pod_finisher.py; kwok deletes by name)."""
    pods = f"/api/v1/namespaces/{namespace}/pods"

    def pod_on(node: str) -> dict[str, Any]:
        container = {"name": "c", "image": "busybox"}
        return {"metadata": {"name": "same-name"},
                "spec": {"nodeName": node, "containers": [container]}}  # fmt: skip

    def running() -> bool:
        found = http_api.get(f"{pods}/same-name")
        return found.status_code == 200 and found.json()["status"].get("phase") == "Running"

    with nodes_held(http_api, [cpu_node(f"finisher-{secrets.token_hex(3)}")]) as [node]:
        first = http_api.post(pods, json=pod_on(node)).json()
        wait_until("the first pod Running", running, timeout=30)
        # A graceful deletion, as a controller's: the node finishes it.
        http_api.delete(f"{pods}/same-name").raise_for_status()
        wait_until("the first pod gone", lambda: http_api.get(f"{pods}/same-name").is_error,
                   timeout=30)  # fmt: skip
        second = http_api.post(pods, json=pod_on(node)).json()
        wait_until("the second pod Running", running, timeout=30)
        # The old pod's deletion replayed, as kwok's stale events replay it.
        deleted = {**first["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}
        stale = {**first, "metadata": deleted}
        PodFinisher(http_api, KWOK_NODE_ANNOTATION).finish(stale)
        survivor = http_api.get(f"{pods}/same-name")
        assert survivor.status_code == 200
        assert survivor.json()["metadata"]["uid"] == second["metadata"]["uid"]
        assert not survivor.json()["metadata"].get("deletionTimestamp")
