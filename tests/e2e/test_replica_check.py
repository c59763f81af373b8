"""A render replica started by hand with another reasoning parser, under steady load on the
real node: the gateways check it before it takes traffic and keep it out, no request fails or
is served by it, and the user sees why (an Event on the pod, ContractVerified on the model)."""

from __future__ import annotations

import copy
import json
import time
from functools import partial
from typing import Any

from devtools.localplane import wait_until
from tests.support.realcluster import (
    MODEL_NAMESPACE,
    Cluster,
    describe,
    model_status,
    pods,
    ready,
)
from tests.support.rollout_load import GATEWAY, GatewayLogs, Load, request_log_on, running

RENDER = "app.kubernetes.io/component=render"
HAND = "sim-qwen3-render-by-hand"


def by_hand(render: dict[str, Any]) -> dict[str, Any]:
    """A copy of an operator-made render pod, as someone would start one: the same labels and
    annotations (so discovery finds it, with the right parity hash) but no owner (no
    pod-template-hash: its ReplicaSet does not adopt it), and no reasoning parser."""
    meta = render["metadata"]
    labels = {k: v for k, v in meta["labels"].items() if k != "pod-template-hash"}
    spec = copy.deepcopy(render["spec"])
    spec.pop("nodeName", None)
    container = spec["containers"][0]
    args = container["args"]
    index = args.index("--reasoning-parser")
    container["args"] = args[:index] + args[index + 2 :]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": HAND, "namespace": MODEL_NAMESPACE, "labels": labels,
                     "annotations": meta.get("annotations", {})},
        "spec": spec,
    }  # fmt: skip


def events_on(cluster: Cluster, pod: str, reason: str) -> list[dict[str, Any]]:
    listing = cluster.kubectl(
        "get", "events", "-n", MODEL_NAMESPACE, "-o", "json",
        "--field-selector", f"involvedObject.name={pod},reason={reason}",
    )  # fmt: skip
    items: list[dict[str, Any]] = json.loads(listing.stdout)["items"]
    return items


def contract(cluster: Cluster) -> dict[str, Any]:
    conditions = model_status(cluster).get("conditions", [])
    return next((c for c in conditions if c["type"] == "ContractVerified"), {})


def test_a_render_replica_started_by_hand_with_another_parser_never_takes_traffic(
    cluster: Cluster, model: str
) -> None:
    request_log_on(cluster)
    wait_until("ContractVerified", lambda: contract(cluster).get("status") == "True",
               timeout=120, interval=1)  # fmt: skip
    gateways = len(pods(cluster, MODEL_NAMESPACE, GATEWAY))
    render = pods(cluster, MODEL_NAMESPACE, RENDER)[0]

    load = Load(model)
    logs = GatewayLogs(cluster.node.pod_logs, MODEL_NAMESPACE)
    workers = [(partial(load.run_one, i), load.stop) for i in range(load.clients)]
    try:
        with running((logs.follow, logs.stop), *workers):
            wait_until("steady load", lambda: len(load.sent) >= 10, timeout=60)
            started = time.monotonic()
            cluster.kubectl("create", "-f", "-", stdin=json.dumps(by_hand(render)))
            wait_until("the hand-started replica Ready", lambda: any(
                ready(p) for p in pods(cluster, MODEL_NAMESPACE, RENDER)
                if p["metadata"]["name"] == HAND
            ), timeout=120, interval=1)  # fmt: skip
            wait_until(
                "a ReplicaContractMismatch Event from every gateway",
                lambda: len(events_on(cluster, HAND, "ReplicaContractMismatch")) >= gateways,
                timeout=60,
                interval=1,
            )
            detected = time.monotonic() - started
            wait_until("ContractVerified=False naming the pod", lambda: HAND in contract(
                cluster).get("message", ""), timeout=120, interval=1)  # fmt: skip
            condition_seconds = time.monotonic() - started
            wide = cluster.kubectl("get", "dm", "-n", MODEL_NAMESPACE, "-o", "wide").stdout
            during = len(load.sent)
            wait_until("requests with the replica kept out", lambda: len(load.sent) >= during + 20,
                       timeout=120)  # fmt: skip
        wait_until("every request in the request log",
                   lambda: not set(load.sent) - set(logs.requests()), timeout=30)  # fmt: skip
        entries = [logs.requests()[request_id] for request_id in load.sent]
    finally:
        logs.close()
        cluster.kubectl("delete", "pod", HAND, "-n", MODEL_NAMESPACE, "--wait", check=False)

    [mismatch, *_] = events_on(cluster, HAND, "ReplicaContractMismatch")
    served_by_hand = [e for e in entries if e["render_engine"] and HAND in e["render_engine"]]
    print(
        f"{len(load.sent)} requests, {len(load.failures)} failed, {len(served_by_hand)} "
        f"rendered by the hand-started replica; mismatch Events {detected:.1f}s after its "
        f"creation, ContractVerified=False after {condition_seconds:.1f}s\n{wide}"
        f"Event: {mismatch['message']}"
    )
    assert load.failures == [], load.failures[:5]
    assert served_by_hand == [], served_by_hand[:3]
    assert "derender content, derender reasoning differ" in mismatch["message"], mismatch
    assert mismatch["type"] == "Warning"
    # Gone with the pod: the model is verified (and Ready) again.
    wait_until(
        "ContractVerified=True once the pod is gone",
        lambda: contract(cluster).get("status") == "True",
        timeout=120,
        interval=1,
    )
    assert model_status(cluster)["phase"] == "Ready", describe(cluster, MODEL_NAMESPACE)
