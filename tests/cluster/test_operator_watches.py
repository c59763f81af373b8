"""The operator's own watches, against the real control plane, with no resync to fall back on:
a model created, and children deleted or edited by hand, are acted on from the watch events
alone; the operator's reads come from what the watches hold."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from devtools.localplane import OPERATOR_USER, ControlPlane, ControlPlaneError, wait_until
from devtools.operator_proc import RunningOperator
from devtools.resources import SMALL_PD_SPEC, apply_dm, get, wait_ready
from pdserve.contract.names import MANAGED_SELECTOR

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("dm_crd")]

RESYNC_SECONDS = 3600  # longer than any test here: nothing waits for a resync (conftest)


def children(http: httpx.Client, namespace: str) -> dict[str, dict[str, Any]]:
    """'Kind/name' -> object, of the kinds a user might delete by hand."""
    found = {}
    for path, kind in (("/api/v1", "services"), ("/api/v1", "configmaps"),
                       ("/api/v1", "serviceaccounts"),
                       ("/apis/rbac.authorization.k8s.io/v1", "rolebindings")):  # fmt: skip
        listed = http.get(f"{path}/namespaces/{namespace}/{kind}",
                          params={"labelSelector": MANAGED_SELECTOR})  # fmt: skip
        listed.raise_for_status()
        for item in listed.json()["items"]:
            found[f"{kind}/{item['metadata']['name']}"] = item
    return found


def test_children_deleted_or_edited_by_hand_are_restored_from_watch_events(
    operator: RunningOperator, http_api: httpx.Client, namespace: str
) -> None:
    apply_dm(http_api, namespace, "qwen", SMALL_PD_SPEC)
    wait_ready(http_api, namespace, "qwen")  # from watch events only: no resync in this module
    made = children(http_api, namespace)
    # One of each kind the operator never watched before its own cache (kopf watched only
    # workloads, Jobs, pods and NetworkPolicies; the rest waited for the resync).
    service = next(k for k in made if k.startswith("services/"))
    config_map = next(k for k in made if k.startswith("configmaps/"))
    binding = next(k for k in made if k.startswith("rolebindings/"))
    for key in (service, binding):
        kind, name = key.split("/")
        path = "/api/v1" if kind == "services" else "/apis/rbac.authorization.k8s.io/v1"
        http_api.delete(f"{path}/namespaces/{namespace}/{kind}/{name}").raise_for_status()
    config_path = f"/api/v1/namespaces/{namespace}/{config_map}"
    original = made[config_map]["data"]
    edited = {key: "edited by hand" for key in original}
    merge = {"Content-Type": "application/merge-patch+json"}
    http_api.patch(config_path, json={"data": edited}, headers=merge).raise_for_status()

    def restored() -> bool:
        now = children(http_api, namespace)
        live = get(http_api, config_path)
        return service in now and binding in now and live is not None and live["data"] == original

    try:
        wait_until("the hand-deleted and hand-edited children to be restored", restored,
                   timeout=30)  # fmt: skip
    except ControlPlaneError as error:
        story = operator.story(namespace, "qwen")
        raise AssertionError(f"{error}; the operator on it:\n{story}") from None
    assert (
        made[service]["metadata"]["uid"]
        != children(http_api, namespace)[service]["metadata"]["uid"]
    )  # a new Service, not the deleted one still terminating


def test_a_model_is_read_from_the_watches_not_listed_per_pass(
    control_plane: ControlPlane, operator: RunningOperator, http_api: httpx.Client, namespace: str
) -> None:
    apply_dm(http_api, namespace, "qwen", SMALL_PD_SPEC)
    wait_ready(http_api, namespace, "qwen")
    seen = control_plane.audit_events(user=OPERATOR_USER, writes_only=False)
    mine = [e for e in seen if e.get("objectRef", {}).get("namespace") == namespace]
    reads = [f"{e['verb']} {e['objectRef']['resource']}" for e in mine
             if e["verb"] in ("get", "list")]  # fmt: skip
    writes = [e for e in mine if e["verb"] not in ("get", "list", "watch")]
    # Every child applied and the status written (the passes ran), each pass reading the
    # model, its children, their pods and the gateways' Events from the watches: before the
    # cache a pass got the model and listed 16 kinds.
    assert len(writes) >= 20
    assert reads == [], f"{len(reads)} reads for {len(writes)} writes: {reads}"
