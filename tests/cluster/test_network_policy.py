"""The operator's NetworkPolicy switch on the real control plane: on, every pool of a model gets
its policy (and one deleted by hand comes back); off, the operator prunes them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from devtools.localplane import ControlPlane, wait_until
from devtools.operator_proc import running_operator
from devtools.resources import SMALL_PD_SPEC, apply_dm, dm_url, get

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("dm_crd")]

POOLS = ("prefill", "decode", "render", "gateway")


def test_network_policies_follow_the_operator_switch(
    control_plane: ControlPlane, http_api: httpx.Client, namespace: str, tmp_path: Path
) -> None:
    base = f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies"

    def policies() -> dict[str, dict[str, object]]:
        items = http_api.get(base).json()["items"]
        return {p["metadata"]["name"]: p for p in items}

    wanted = {f"qwen-{pool}" for pool in POOLS}
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    switched_on = ["--network-policies", "--network-policy-metrics-namespace=monitoring"]
    with running_operator(
        control_plane, tmp_path / "on", resync_seconds=60, extra_args=switched_on
    ):
        apply_dm(http_api, namespace, "qwen", SMALL_PD_SPEC)
        wait_until("a NetworkPolicy per pool", lambda: set(policies()) == wanted, timeout=60)
        dm = get(http_api, dm_url(namespace, "qwen"))
        assert dm is not None
        decode = policies()["qwen-decode"]
        [owner] = decode["metadata"]["ownerReferences"]  # type: ignore[index]
        assert owner["uid"] == dm["metadata"]["uid"]
        assert decode["spec"]["podSelector"] == {  # type: ignore[index]
            "matchLabels": {"pdserve.io/model": "qwen", "app.kubernetes.io/component": "decode"}
        }
        # Resync is 60 s: a hand-deleted policy comes back through the operator's watch.
        http_api.delete(f"{base}/qwen-decode").raise_for_status()
        wait_until("the deleted policy to be restored", lambda: "qwen-decode" in policies(),
                   timeout=30)  # fmt: skip

    with running_operator(control_plane, tmp_path / "off", resync_seconds=60):
        # Started with the switch off: its first reconcile prunes what the earlier one made.
        wait_until("the NetworkPolicies to be pruned", lambda: not policies(), timeout=60)
        gateway = f"/apis/apps/v1/namespaces/{namespace}/deployments/qwen-gateway"
        assert get(http_api, gateway) is not None  # the rest of the model stays
