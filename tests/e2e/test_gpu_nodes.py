"""One plane, two kinds of node: a GPU-shaped model's engines are scheduled onto the fake H200
nodes (kwok plays their pods) while its gateway runs for real on the real node."""

from __future__ import annotations

import json

from tests.support.realcluster import GPU_TAINT, Cluster, describe, pods, ready

NAMESPACE = "gpu"
MODEL = {
    "apiVersion": "pdserve.io/v1alpha1",
    "kind": "DisaggregatedModel",
    "metadata": {"name": "llama-8b", "namespace": NAMESPACE},
    "spec": {
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 1},
        "render": {"enabled": False},
        "kvTransfer": {"verify": "Off"},
        "placement": {"tolerations": [{**GPU_TAINT, "operator": "Equal"}]},
        "gateway": {"replicas": 1, "resources": {"requests": {"cpu": "50m", "memory": "128Mi"},
                                                 "limits": {"memory": "512Mi"}}},
    },
}  # fmt: skip


def test_gpu_engines_land_on_fake_gpu_nodes_and_the_gateway_runs_on_the_real_node(
    cluster: Cluster, operator: None
) -> None:
    cluster.kubectl("create", "namespace", NAMESPACE)
    try:
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(MODEL))
        waited = cluster.kubectl(
            "wait", "--for=condition=Ready", "dm/llama-8b", "-n", NAMESPACE, "--timeout=3m",
            check=False, timeout=240,
        )  # fmt: skip
        assert waited.returncode == 0, waited.stderr + describe(cluster, NAMESPACE)
        placed = {
            p["metadata"]["labels"]["app.kubernetes.io/component"]: p
            for p in pods(cluster, NAMESPACE)
        }
        for engine in ("prefill", "decode"):
            pod = placed[engine]
            assert pod["spec"]["nodeName"].startswith("gpu-"), pod["spec"]["nodeName"]
            limits = pod["spec"]["containers"][0]["resources"]["limits"]
            assert limits["nvidia.com/gpu"] == "1", limits
        gateway = placed["gateway"]
        assert gateway["spec"]["nodeName"] == "real-node"
        assert ready(gateway)
        # A real process, Ready through its own probe on the node's bridge.
        [status] = gateway["status"]["containerStatuses"]
        assert "running" in status["state"], status
    finally:
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
