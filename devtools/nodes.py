"""Fake nodes for the local control plane: kwok keeps them Ready and runs their pods.

GPU nodes carry the labels and extended resources real GPU clusters have (NVIDIA GPU feature
discovery labels, an NVLink clique, zone and rack topology, an RDMA shared device), so the real
scheduler makes the same placement decisions it would make on hardware.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from devtools.localplane import ControlPlaneError, wait_until
from devtools.planecommands import KWOK_NODE_ANNOTATION

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
NVLINK_CLIQUE_LABEL = "nvidia.com/gpu.clique"
ZONE_LABEL = "topology.kubernetes.io/zone"
RACK_LABEL = "topology.kubernetes.io/rack"
RDMA_RESOURCE = "rdma/rdma_shared_device_a"


@dataclass(frozen=True)
class FakeNode:
    """What a node offers; ``manifest()`` turns it into a Node object kwok will manage."""

    name: str
    cpu: str = "32"
    memory: str = "256Gi"
    pods: int = 110
    gpus: int = 0
    gpu_product: str = "NVIDIA-H200"
    gpu_memory_mib: int = 143771
    nvlink_clique: str | None = None
    zone: str = "zone-a"
    rack: str | None = None
    rdma_devices: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, str], ...] = ()

    def manifest(self) -> dict[str, Any]:
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            ZONE_LABEL: self.zone,
        }
        capacity: dict[str, str] = {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": str(self.pods),
            "ephemeral-storage": "1Ti",
        }
        if self.rack:
            labels[RACK_LABEL] = self.rack
        if self.gpus:
            labels |= {
                GPU_PRODUCT_LABEL: self.gpu_product,
                GPU_COUNT_LABEL: str(self.gpus),
                GPU_MEMORY_LABEL: str(self.gpu_memory_mib),
                "nvidia.com/gpu.present": "true",
            }
            capacity[GPU_RESOURCE] = str(self.gpus)
        if self.nvlink_clique:
            labels[NVLINK_CLIQUE_LABEL] = self.nvlink_clique
        if self.rdma_devices:
            capacity[RDMA_RESOURCE] = str(self.rdma_devices)
        labels |= self.labels
        key, value = KWOK_NODE_ANNOTATION
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": labels, "annotations": {key: value}},
            "spec": {"taints": [dict(t) for t in self.taints]},
            "status": {"capacity": capacity, "allocatable": dict(capacity)},
        }


def gpu_node(
    name: str,
    *,
    gpus: int = 8,
    product: str = "NVIDIA-H200",
    clique: str | None = "cluster-0.0",
    zone: str = "zone-a",
    rack: str = "rack-0",
    rdma_devices: int = 16,
    **extra: Any,
) -> FakeNode:
    """An HGX-style GPU node: 8 GPUs in one NVLink clique, an RDMA shared device that up to 16
    pods may use (the shared device plugin's rdmaHcaMax)."""
    return FakeNode(
        name=name,
        gpus=gpus,
        gpu_product=product,
        nvlink_clique=clique,
        zone=zone,
        rack=rack,
        rdma_devices=rdma_devices,
        **extra,
    )


def cpu_node(name: str, *, cpu: str = "16", memory: str = "64Gi", zone: str = "zone-a") -> FakeNode:
    return FakeNode(name=name, cpu=cpu, memory=memory, zone=zone)


def demo_nodes() -> list[FakeNode]:
    """Two racks of H200 nodes, each rack one NVLink clique, plus two CPU nodes."""
    return [
        gpu_node("gpu-r0-0", clique="cluster-0.0", rack="rack-0"),
        gpu_node("gpu-r0-1", clique="cluster-0.0", rack="rack-0"),
        gpu_node("gpu-r1-0", clique="cluster-0.1", rack="rack-1"),
        gpu_node("gpu-r1-1", clique="cluster-0.1", rack="rack-1"),
        cpu_node("cpu-0"),
        cpu_node("cpu-1"),
    ]


def create_nodes(http: httpx.Client, nodes: Iterable[FakeNode]) -> list[str]:
    """Create (or replace) the nodes; returns their names."""
    names = []
    for node in nodes:
        body = node.manifest()
        response = http.post("/api/v1/nodes", json=body)
        if response.status_code == 409:
            http.delete(f"/api/v1/nodes/{node.name}").raise_for_status()
            gone_url = f"/api/v1/nodes/{node.name}"
            wait_until(
                f"node {node.name} to be deleted",
                lambda: http.get(gone_url).status_code == 404,  # noqa: B023 - called right here
                timeout=30,
            )
            response = http.post("/api/v1/nodes", json=body)
        if not response.is_success:
            raise ControlPlaneError(f"creating node {node.name}: {response.text}")
        names.append(node.name)
    return names


def node_ready(node: Mapping[str, Any]) -> bool:
    conditions = node.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def wait_nodes_ready(http: httpx.Client, names: Iterable[str], *, timeout: float = 60) -> None:
    pending = set(names)

    def all_ready() -> bool:
        for name in sorted(pending):
            response = http.get(f"/api/v1/nodes/{name}")
            if response.is_success and node_ready(response.json()):
                pending.discard(name)
        return not pending

    wait_until(f"nodes {sorted(pending)} to become Ready", all_ready, timeout=timeout)
