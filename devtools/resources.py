"""Helpers for DisaggregatedModels and their children on the local plane (raw API calls)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from devtools.localplane import wait_until

APPLY = {"Content-Type": "application/apply-patch+yaml"}
# 1 prefill + 1 decode + render (HPA) + 1 gateway: the smallest complete P/D deployment.
SMALL_PD_SPEC: dict[str, Any] = {
    "model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
    "serving": {"toolCallParser": "hermes", "enableAutoToolChoice": True},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
    "render": {"autoscaling": {"minReplicas": 1, "maxReplicas": 4}},
    "gateway": {"replicas": 1},
}

# A minimal ScaledObject CRD (keda.sh/v1alpha1): enough for the API server to accept and store
# the object pdserve builds; KEDA's own CRD validates the fields in a real cluster.
KEDA_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "scaledobjects.keda.sh"},
    "spec": {
        "group": "keda.sh",
        "scope": "Namespaced",
        "names": {"kind": "ScaledObject", "listKind": "ScaledObjectList",
                  "plural": "scaledobjects", "singular": "scaledobject"},
        "versions": [{
            "name": "v1alpha1", "served": True, "storage": True,
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "required": ["spec"],
                "properties": {"spec": {
                    "type": "object",
                    "required": ["scaleTargetRef", "triggers"],
                    "x-kubernetes-preserve-unknown-fields": True,
                    "properties": {
                        "scaleTargetRef": {"type": "object", "required": ["name"],
                                           "x-kubernetes-preserve-unknown-fields": True},
                        "triggers": {"type": "array", "minItems": 1, "items": {
                            "type": "object", "required": ["type", "metadata"],
                            "x-kubernetes-preserve-unknown-fields": True,
                        }},
                    },
                }},
            }},
        }],
    },
}  # fmt: skip


def dm_url(namespace: str, name: str = "") -> str:
    base = f"/apis/pdserve.io/v1alpha1/namespaces/{namespace}/disaggregatedmodels"
    return f"{base}/{name}" if name else base


def apply_dm(http: httpx.Client, namespace: str, name: str, spec: dict[str, Any]) -> None:
    body = {"apiVersion": "pdserve.io/v1alpha1", "kind": "DisaggregatedModel",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}  # fmt: skip
    response = server_side_apply(http, dm_url(namespace, name), body, "user")
    assert response.is_success, response.text


def server_side_apply(
    http: httpx.Client, path: str, body: dict[str, Any], field_manager: str, *, force: bool = False
) -> httpx.Response:
    """PATCH ``body`` to ``path`` as a server-side apply by ``field_manager``."""
    params = {"fieldManager": field_manager, **({"force": "true"} if force else {})}
    return http.patch(path, params=params, content=json.dumps(body), headers=APPLY)


def get(http: httpx.Client, path: str) -> dict[str, Any] | None:
    response = http.get(path)
    if response.status_code == 404:
        return None
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def conditions(dm: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in ((dm or {}).get("status") or {}).get("conditions", [])}


def wait_ready(
    http: httpx.Client, namespace: str, name: str, timeout: float = 90
) -> dict[str, Any]:
    def ready() -> bool:
        dm = get(http, dm_url(namespace, name))
        return (
            conditions(dm).get("Ready", {}).get("status") == "True"
            and (dm or {})["status"].get("observedGeneration")
            == (dm or {})["metadata"]["generation"]
        )

    wait_until(f"{namespace}/{name} to be Ready", ready, timeout=timeout)
    dm = get(http, dm_url(namespace, name))
    assert dm is not None
    return dm


def events_for(http: httpx.Client, namespace: str, name: str) -> list[dict[str, Any]]:
    selector = {"fieldSelector": f"involvedObject.name={name}"}
    items = http.get(f"/api/v1/namespaces/{namespace}/events", params=selector).json()["items"]
    return list(items)
