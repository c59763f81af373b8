"""Topology placement on the real scheduler, and the transport preflight that follows it: kwok
GB200 NVL72 compute trays in two multi-node NVLink domains (nvidia.com/gpu.clique CLIQUE_0 =
gb200-c0-*, CLIQUE_1 = gb200-c1-*, 4 GPUs a tray, 8 a domain), the only nodes that carry the
clique label; the H200 and L40S nodes of the demo cluster carry none. kwok cannot run the probe,
so the test hands each probe pod the report a real probe writes (see tests/sim/test_kvprobe.py
for the real thing)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from devtools.localplane import ControlPlane, wait_until
from devtools.nodes import NVLINK_CLIQUE_LABEL, RDMA_RESOURCE
from devtools.operator_proc import RunningOperator, running_operator
from devtools.resources import SMALL_PD_SPEC, apply_dm, conditions, dm_url, get, wait_ready
from pdserve.api.gpu_products import GB200

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("dm_crd")]


@pytest.fixture(scope="module")
def operator(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningOperator]:
    with running_operator(
        control_plane, tmp_path_factory.mktemp("operator"), resync_seconds=2
    ) as running:
        yield running


def engine_pods(http: httpx.Client, namespace: str) -> list[dict[str, Any]]:
    selector = "app.kubernetes.io/component in (prefill,decode)"
    pods = http.get(f"/api/v1/namespaces/{namespace}/pods", params={"labelSelector": selector})
    return list(pods.json()["items"])


def clique_of(http: httpx.Client) -> dict[str, str]:
    nodes = http.get("/api/v1/nodes").json()["items"]
    return {
        n["metadata"]["name"]: n["metadata"]["labels"][NVLINK_CLIQUE_LABEL]
        for n in nodes
        if NVLINK_CLIQUE_LABEL in n["metadata"].get("labels", {})
    }


def gpus_free_of_other_tests(http: httpx.Client, namespace: str) -> None:
    """Earlier tests' namespaces are deleted asynchronously; their GPU pods must be gone before
    a test that counts on the domains' capacity."""

    def holds_gpus(pod: dict[str, Any]) -> bool:
        return any(
            "nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
            for c in pod.get("spec", {}).get("containers", [])
        )

    def others() -> list[str]:
        pods = http.get("/api/v1/pods").json()["items"]
        return [
            f"{p['metadata']['namespace']}/{p['metadata']['name']}"
            for p in pods
            if p["metadata"]["namespace"] != namespace
            and p.get("spec", {}).get("nodeName")
            and holds_gpus(p)
        ]

    wait_until("GPU pods of earlier tests to go away", lambda: not others(), timeout=120)


SLICED: dict[str, Any] = {
    **SMALL_PD_SPEC,
    "prefill": {"replicas": 1, "tensorParallelSize": 2,
                "resources": {"requests": {"cpu": "4", "memory": "16Gi"}}},
    "decode": {"replicas": 1, "tensorParallelSize": 2,
               "resources": {"requests": {"cpu": "4", "memory": "16Gi"}}},
    "placement": {
        "gpuProducts": [GB200.product],
        "slices": 2,
        "domain": {"topologyKey": NVLINK_CLIQUE_LABEL, "spreadSlices": "Required"},
        "rdma": {"resource": RDMA_RESOURCE},
    },
}  # fmt: skip


@pytest.mark.usefixtures("operator")
def test_each_slice_lands_in_one_nvlink_domain_and_slices_spread(
    http_api: httpx.Client, namespace: str
) -> None:
    gpus_free_of_other_tests(http_api, namespace)
    apply_dm(http_api, namespace, "sliced", SLICED)
    dm = wait_ready(http_api, namespace, "sliced")
    assert dm["status"]["pools"]["prefill"]["summary"] == "2/2"
    assert dm["status"]["pools"]["decode"]["summary"] == "2/2"

    cliques = clique_of(http_api)
    slices: dict[str, set[str]] = {}
    for pod in engine_pods(http_api, namespace):
        slice_index = pod["metadata"]["labels"]["pdserve.io/slice"]
        slices.setdefault(slice_index, set()).add(cliques[pod["spec"]["nodeName"]])
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert limits[RDMA_RESOURCE] == "1"
        assert pod["status"]["qosClass"] == "Guaranteed"
    assert sorted(slices) == ["0", "1"]
    assert all(len(domains) == 1 for domains in slices.values()), slices
    assert slices["0"] != slices["1"], "spreadSlices: Required puts slices in different domains"
    placed = conditions(dm)["Placement"]
    assert (placed["status"], placed["reason"]) == ("True", "Placed")
    assert placed["message"].startswith("slice 0 on gb200-")


@pytest.mark.usefixtures("operator")
def test_a_slice_too_big_for_its_domain_waits_and_placement_says_why(
    http_api: httpx.Client, namespace: str
) -> None:
    """12 GB200 GPUs in one slice (three engines of 4, one tray each): the cluster has 16 GB200
    GPUs, but no NVLink domain has more than 8."""
    gpus_free_of_other_tests(http_api, namespace)
    spec = {
        **SMALL_PD_SPEC,
        "prefill": {"replicas": 1, "tensorParallelSize": 4},
        "decode": {"replicas": 2, "tensorParallelSize": 4},
        "placement": {
            "gpuProducts": [GB200.product],
            "domain": {"topologyKey": NVLINK_CLIQUE_LABEL},
        },
    }
    apply_dm(http_api, namespace, "big", spec)

    def placement() -> dict[str, Any]:
        return conditions(get(http_api, dm_url(namespace, "big"))).get("Placement", {})

    wait_until("Placement=False", lambda: placement().get("status") == "False", timeout=60)
    message = placement()["message"]
    assert placement()["reason"] == "Unschedulable"
    assert "nodes are available" in message  # the scheduler's own words
    assert "Insufficient nvidia.com/gpu" in message or "pod affinity" in message, message
    assert "placement.domain nvidia.com/gpu.clique is Required" in message
    for pod in engine_pods(http_api, namespace):
        assert RDMA_RESOURCE not in pod["spec"]["containers"][0]["resources"]["limits"]
    bound = [p for p in engine_pods(http_api, namespace) if p["spec"].get("nodeName")]
    assert len({clique_of(http_api)[p["spec"]["nodeName"]] for p in bound}) == 1

    # Preferred lets the scheduler break the domain: every pod is placed.
    spec["placement"] = {
        "gpuProducts": [GB200.product],
        "domain": {"topologyKey": NVLINK_CLIQUE_LABEL, "mode": "Preferred"},
    }
    apply_dm(http_api, namespace, "big", spec)
    wait_until("Placement=True", lambda: placement().get("status") == "True", timeout=90)


def probe_report(role: str, node: str, transport: str) -> dict[str, Any]:
    lane = {"rdma": "rc_mlx5/mlx5_0:1", "tcp": "tcp/eth0"}[transport]
    return {
        "role": role, "node": node, "ok": True, "transport": transport, "readPath": [lane],
        "bandwidthGBps": 23.1 if transport == "rdma" else 1.2, "latencyMs": 2.9, "bytes": 2**26,
        "dataIntact": True, "p2p": {"status": "OK"},
        "rdmaDevices": [{"device": "mlx5_0", "port": 1, "state": "ACTIVE", "linkLayer": "IB"}],
    }  # fmt: skip


@pytest.mark.usefixtures("operator")
def test_preflight_probes_each_slice_on_its_nodes_and_names_a_tcp_fallback(
    http_api: httpx.Client, namespace: str
) -> None:
    gpus_free_of_other_tests(http_api, namespace)
    spec = {**SLICED, "kvTransfer": {"verify": "Required", "ucxTransports": "rc,cuda_copy"}}
    apply_dm(http_api, namespace, "probed", spec)
    wait_ready(http_api, namespace, "probed")
    jobs_url = f"/apis/batch/v1/namespaces/{namespace}/jobs"

    def jobs() -> list[dict[str, Any]]:
        return list(http_api.get(jobs_url).json()["items"])

    wait_until("a preflight Job per slice", lambda: len(jobs()) == 2, timeout=60)
    nodes_of_slice: dict[str, set[str]] = {}
    for pod in engine_pods(http_api, namespace):
        slice_index = pod["metadata"]["labels"]["pdserve.io/slice"]
        nodes_of_slice.setdefault(slice_index, set()).add(pod["spec"]["nodeName"])
    for job in jobs():
        slice_index = job["metadata"]["labels"]["pdserve.io/slice"]
        terms = job["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]  # fmt: skip
        assert set(terms[0]["matchExpressions"][0]["values"]) == nodes_of_slice[slice_index]
        env = {e["name"]: e.get("value") for e in
               job["spec"]["template"]["spec"]["containers"][0]["env"]}  # fmt: skip
        assert env["UCX_TLS"] == "rc,cuda_copy"

    pods_url = f"/api/v1/namespaces/{namespace}/pods"
    selector = {"labelSelector": "app.kubernetes.io/component=preflight"}

    def probes() -> list[dict[str, Any]]:
        items = http_api.get(pods_url, params=selector).json()["items"]
        return [p for p in items if p.get("status", {}).get("phase") == "Running"]

    wait_until("4 probe pods running", lambda: len(probes()) == 4, timeout=60)
    for pod in probes():
        labels = pod["metadata"]["labels"]
        role = "server" if labels["batch.kubernetes.io/job-completion-index"] == "0" else "client"
        # Slice 1's NIC path is broken: UCX carried the data over TCP.
        transport = "tcp" if labels["pdserve.io/slice"] == "1" and role == "client" else "rdma"
        report = json.dumps(probe_report(role, pod["spec"]["nodeName"], transport))
        patch = {"metadata": {"annotations": {"pdserve.io/kwok-termination-message": report}}}
        response = http_api.patch(
            f"{pods_url}/{pod['metadata']['name']}", json=patch,
            headers={"Content-Type": "application/merge-patch+json"},
        )  # fmt: skip
        assert response.is_success, response.text

    def verdicts() -> list[dict[str, Any]]:
        dm = get(http_api, dm_url(namespace, "probed")) or {}
        return list((dm.get("status") or {}).get("transport", []))

    wait_until(
        "both slices judged",
        lambda: [t.get("verified") for t in verdicts()] == [True, False],
        timeout=60,
    )
    first, second = verdicts()
    assert (first["reason"], first["transport"], first["bandwidthGBps"]) == (
        "Verified",
        "rdma",
        23.1,
    )
    assert second["reason"] == "TCPFallback"
    assert "placement.rdma is set but the data went over tcp" in second["message"]
    verified = conditions(get(http_api, dm_url(namespace, "probed")))["TransportVerified"]
    assert (verified["status"], verified["reason"]) == ("False", "TCPFallback")
    assert verified["message"].startswith("slice 1: ")

    def annotations() -> dict[str, str | None]:
        return {
            p["metadata"]["name"]: p["metadata"]
            .get("annotations", {})
            .get("pdserve.io/kv-transport")
            for p in engine_pods(http_api, namespace)
        }

    wait_until(
        "engine pods annotated with their slice's verdict",
        lambda: all(
            value == ("Verified" if "-s0-" in name else "Failed")
            for name, value in annotations().items()
        ),
        timeout=30,
    )
