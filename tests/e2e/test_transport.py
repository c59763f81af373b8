"""The KV transport preflight for real: the operator's probe Job moves data with NIXL between
two pods on the real node, and TransportVerified comes from that run."""

from __future__ import annotations

import json
from typing import Any

from devtools.localplane import wait_until
from tests.support.realcluster import (
    MODEL_NAMESPACE,
    Cluster,
    describe,
    model_status,
    operator_logs,
    pods,
)


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def test_preflight_probe_runs_between_two_real_pods_and_sets_transport_verified(
    cluster: Cluster, model: str
) -> None:
    patch = {"spec": {"kvTransfer": {"verify": "Warn"}}}
    cluster.kubectl("patch", "dm", "sim-qwen3", "-n", MODEL_NAMESPACE, "--type=merge",
                    "-p", json.dumps(patch))  # fmt: skip

    def reported() -> bool:
        slices = model_status(cluster).get("transport", [])
        return bool(slices) and slices[0].get("verified") is not None

    try:
        wait_until("the probe's verdict", reported, timeout=240, interval=2)
    except Exception as error:
        raise AssertionError(f"{error}\n{describe(cluster, MODEL_NAMESPACE)}"
                             f"{operator_logs(cluster)}") from error  # fmt: skip
    status = model_status(cluster)
    [verdict] = status["transport"]
    print(f"preflight: {verdict['message']}")  # shown with -s

    # Two probe pods ran to completion on the real node: the numbers are theirs.
    def probes() -> list[dict[str, Any]]:
        return pods(cluster, MODEL_NAMESPACE, "app.kubernetes.io/component=preflight")

    wait_until(
        "both probe pods to succeed",
        lambda: [p["status"]["phase"] for p in probes()] == ["Succeeded"] * 2,
        timeout=60,
    )
    assert {p["spec"]["nodeName"] for p in probes()} == {"real-node"}
    assert verdict["verified"] is True, verdict
    assert verdict["reason"] == "Verified", verdict
    # UCX over TCP between the two pods' addresses: this machine has no RDMA device.
    assert verdict["transport"] == "tcp", verdict
    assert verdict["bandwidthGBps"] > 0, verdict
    assert verdict["latencyMs"] > 0, verdict
    verified = condition(status, "TransportVerified")
    assert verified["status"] == "True", verified
    assert "tcp" in verified["message"], verified
