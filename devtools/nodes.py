"""Fake nodes for the local control plane: kwok keeps them Ready and runs their pods.

Each GPU profile is a twin of a real node: the labels GPU Feature Discovery (GFD), Node Feature
Discovery (NFD) and the kubelet put on it, and the capacity the kubelet and the device plugins
report, so the real scheduler makes the same placement decisions it would make on hardware. A
label no real node carries is a bug in the twin. In particular `nvidia.com/gpu.clique` is only on
multi-node NVLink nodes (GB200 NVL72 compute trays): GFD writes it only for GPUs attached to a
completed NVLink fabric (NVIDIA/k8s-device-plugin internal/lm/imex.go). On HGX H100/H200 the
NVLink domain is the node itself (kubernetes.io/hostname). No real system publishes a
`topology.kubernetes.io/rack` label (the kubelet presets only hostname, os, arch, instance-type,
region and zone: kubernetes.io/docs/reference/node/node-labels), so the twin has none.

GPU product strings, memory and architecture come from `pdserve.api.gpu_products`, the one place
those facts live.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from devtools.localplane import ControlPlaneError, wait_until
from devtools.planecommands import KWOK_NODE_ANNOTATION
from pdserve.api.gpu_products import (
    CLIQUE_LABEL,
    GB200,
    H100_80GB_HBM3,
    H200,
    L40S,
    MEMORY_LABEL,
    PRODUCT_LABEL,
    GpuProduct,
    lookup,
)

GPU_RESOURCE = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = PRODUCT_LABEL
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
GPU_MEMORY_LABEL = MEMORY_LABEL
NVLINK_CLIQUE_LABEL = CLIQUE_LABEL
HOSTNAME_LABEL = "kubernetes.io/hostname"
ZONE_LABEL = "topology.kubernetes.io/zone"
# The network operator's RDMA shared device plugin: one resource shared by up to rdmaHcaMax pods.
# NVIDIA network-operator NicClusterPolicy examples configure
# {"resourceName": "rdma_shared_device_a", "rdmaHcaMax": 63} with the default prefix "rdma".
RDMA_RESOURCE = "rdma/rdma_shared_device_a"
RDMA_HCA_MAX = 63

# One example driver: GB200 trays in sgl-project/sglang#11208 ran 570.172.08 with CUDA 12.8
# runtimes; GFD writes both the deprecated and the current spellings (internal/lm/nvml.go).
DRIVER_VERSION = "570.172.08"
CUDA_VERSION = "12.8"
# Example kernels (NFD's kernel-version labels), values illustrative: Ubuntu 24.04's GA kernel on
# amd64 and Ubuntu's linux-nvidia-64k flavour on Grace (arm64).
KERNEL_AMD64 = "6.8.0-60-generic"
KERNEL_ARM64 = "6.8.0-1025-nvidia-64k"


@dataclass(frozen=True)
class FakeNode:
    """What a node offers; ``manifest()`` turns it into a Node object kwok will manage.

    ``allocatable`` overrides capacity entries, as the kubelet's system/kube reservations and
    eviction threshold do on a real node (allocatable = capacity - reserved - eviction)."""

    name: str
    cpu: str = "32"
    memory: str = "256Gi"
    ephemeral_storage: str = "1Ti"
    pods: int = 110
    allocatable: Mapping[str, str] = field(default_factory=dict)
    arch: str = "amd64"
    gpus: int = 0
    gpu: GpuProduct | None = None
    gpu_machine: str = "unknown"
    nvlink_clique: str | None = None
    zone: str = "zone-a"
    rdma_devices: int = 0
    mellanox_nics: bool = False
    numa_nodes: int = 1
    kernel: str = KERNEL_AMD64
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.gpus and self.gpu is None:
            raise ValueError(f"node {self.name}: {self.gpus} GPUs but no GPU product")
        if self.nvlink_clique and not (self.gpu and self.gpu.multi_node_nvlink):
            product = self.gpu.product if self.gpu else "no GPU"
            raise ValueError(
                f"node {self.name}: {product} never carries {CLIQUE_LABEL} (GFD sets it only "
                "on multi-node NVLink GPUs such as GB200 NVL72)"
            )

    def manifest(self) -> dict[str, Any]:
        # kubelet: the preset labels, the deprecated beta.* spellings included (still written).
        labels = {
            HOSTNAME_LABEL: self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": self.arch,
            "beta.kubernetes.io/os": "linux",
            "beta.kubernetes.io/arch": self.arch,
            ZONE_LABEL: self.zone,
        }
        labels |= _nfd_labels(self)
        capacity: dict[str, str] = {
            "cpu": self.cpu,
            "memory": self.memory,
            "pods": str(self.pods),
            "ephemeral-storage": self.ephemeral_storage,
            "hugepages-1Gi": "0",
            "hugepages-2Mi": "0",
        }
        if self.gpus and self.gpu is not None:
            labels |= _gfd_labels(self.gpu, self.gpus, self.gpu_machine)
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
            "status": {"capacity": capacity, "allocatable": capacity | dict(self.allocatable)},
        }


def _gfd_labels(gpu: GpuProduct, count: int, machine: str) -> dict[str, str]:
    """What GFD (with the GPU operator's gpu.present) writes for full GPUs, no sharing, no MIG:
    NVIDIA/k8s-device-plugin internal/lm/{resource,nvml,machine-type}.go; the set matches the
    labels printed on real H100 and L40S nodes (gpu.replicas=1, sharing-strategy=none,
    mps.capable=false, gpu.mode=compute)."""
    major, minor, rev = DRIVER_VERSION.split(".")
    cuda_major, cuda_minor = CUDA_VERSION.split(".")
    return {
        "nvidia.com/gpu.present": "true",
        PRODUCT_LABEL: gpu.product,
        GPU_COUNT_LABEL: str(count),
        MEMORY_LABEL: str(gpu.memory_mib),
        "nvidia.com/gpu.family": gpu.family.value,
        "nvidia.com/gpu.compute.major": str(gpu.compute_major),
        "nvidia.com/gpu.compute.minor": str(gpu.compute_minor),
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/gpu.mode": "compute",
        "nvidia.com/gpu.machine": machine,
        # L40S has no MIG; Hopper and Blackwell data-centre GPUs do.
        "nvidia.com/mig.capable": "false" if gpu is L40S else "true",
        "nvidia.com/mps.capable": "false",
        "nvidia.com/cuda.driver-version.full": DRIVER_VERSION,
        "nvidia.com/cuda.driver-version.major": major,
        "nvidia.com/cuda.driver-version.minor": minor,
        "nvidia.com/cuda.driver-version.revision": rev,
        "nvidia.com/cuda.driver.major": major,
        "nvidia.com/cuda.driver.minor": minor,
        "nvidia.com/cuda.driver.rev": rev,
        "nvidia.com/cuda.runtime-version.full": CUDA_VERSION,
        "nvidia.com/cuda.runtime-version.major": cuda_major,
        "nvidia.com/cuda.runtime-version.minor": cuda_minor,
        "nvidia.com/cuda.runtime.major": cuda_major,
        "nvidia.com/cuda.runtime.minor": cuda_minor,
    }


def _nfd_labels(node: FakeNode) -> dict[str, str]:
    """NFD's default feature labels that matter here (names as on real nodes, e.g. an EKS p4d
    node's `kubectl describe`): PCI vendors present (10de NVIDIA, 15b3 Mellanox/NVIDIA NICs),
    RDMA, kernel version, NUMA. CPU-model labels are left out: their values on Grace are not
    confirmed."""
    kernel_major, kernel_minor, rest = node.kernel.split(".", 2)
    labels = {
        "feature.node.kubernetes.io/kernel-version.full": node.kernel,
        "feature.node.kubernetes.io/kernel-version.major": kernel_major,
        "feature.node.kubernetes.io/kernel-version.minor": kernel_minor,
        "feature.node.kubernetes.io/kernel-version.revision": rest.split("-", 1)[0],
        "feature.node.kubernetes.io/system-os_release.ID": "ubuntu",
        "feature.node.kubernetes.io/system-os_release.VERSION_ID": "24.04",
    }
    if node.gpus:
        labels["feature.node.kubernetes.io/pci-10de.present"] = "true"
    if node.numa_nodes > 1:
        labels["feature.node.kubernetes.io/memory-numa"] = "true"
    if node.mellanox_nics:
        labels["feature.node.kubernetes.io/pci-15b3.present"] = "true"
        labels["feature.node.kubernetes.io/rdma.capable"] = "true"
    if node.rdma_devices:  # the network operator's driver loaded: the RDMA stack is up
        labels["feature.node.kubernetes.io/rdma.available"] = "true"
    return labels


def _allocatable(cpu: int, memory_gi: int, storage_gi: int, *, pods: int) -> dict[str, str]:
    """Allocatable a little below capacity, as kubelet reservations leave it (an EKS p4d node:
    cpu 96 -> 95690m, memory about 8 GiB less, ephemeral-storage about 8% less)."""
    reserved_millicores = 100 + 2 * cpu  # system/kube reserved grow with the core count
    reserved_mi = 1024 + 4 * memory_gi  # plus the 100Mi hard eviction threshold
    return {
        "cpu": f"{cpu * 1000 - reserved_millicores}m",
        "memory": f"{memory_gi * 1024 - reserved_mi - 100}Mi",
        "ephemeral-storage": f"{storage_gi * 92 // 100}Gi",
        "pods": str(pods),
    }


def hgx_h100_node(name: str, *, zone: str = "zone-a", **extra: Any) -> FakeNode:
    """DGX/HGX H100: 8x H100 80GB SXM in one NVLink/NVSwitch domain (the node), 2x Xeon Platinum
    8480C (2x56 cores, 224 threads), 2 TiB DDR5, 8 single-port ConnectX-7 for the compute fabric
    (NVIDIA DGX H100 user guide, docs.nvidia.com/dgx/dgxh100-user-guide). No clique label."""
    return _hgx_node(name, H100_80GB_HBM3, machine="DGX-H100", zone=zone, **extra)


def hgx_h200_node(name: str, *, zone: str = "zone-a", **extra: Any) -> FakeNode:
    """DGX/HGX H200: as the H100 board with 8x H200 141GB (the DGX H200 shares the H100's user
    guide and its CPUs, memory and NICs). No clique label."""
    return _hgx_node(name, H200, machine="DGX-H200", zone=zone, **extra)


def _hgx_node(name: str, gpu: GpuProduct, *, machine: str, zone: str, **extra: Any) -> FakeNode:
    cpu, memory_gi, storage_gi, pods = 224, 2048, 30720, 110  # 8x 3.84 TB NVMe U.2 cache
    fields: dict[str, Any] = {
        "name": name,
        "cpu": str(cpu),
        "memory": f"{memory_gi}Gi",
        "ephemeral_storage": f"{storage_gi}Gi",
        "pods": pods,
        "allocatable": _allocatable(cpu, memory_gi, storage_gi, pods=pods),
        "gpus": gpu.gpus_per_node,
        "gpu": gpu,
        "gpu_machine": machine,
        "zone": zone,
        "rdma_devices": RDMA_HCA_MAX,
        "mellanox_nics": True,
        "numa_nodes": 2,
    }
    return FakeNode(**(fields | extra))


def gb200_nvl72_node(name: str, *, clique: str, zone: str = "zone-a", **extra: Any) -> FakeNode:
    """One GB200 NVL72 compute tray: 2 GB200 superchips = 2 Grace CPUs (72 Arm cores each, no
    SMT: CPU affinity 0-71 and 72-143 in sgl-project/sglang#11208) + 4 Blackwell GPUs, arm64.
    Its GPUs share an NVLink domain with the other trays of the rack, so GFD writes
    nvidia.com/gpu.clique = "<fabric ClusterUUID>.<CliqueId>" (imex.go; e.g.
    7b968a6d-c8aa-45e1-9e07-e1e51be99c31.1 in GFD's README). GFD publishes no other IMEX label;
    the NVIDIA DRA driver's ComputeDomain labels nodes only while a domain runs on them.
    Memory: 960Gi as NVIDIA/aicr's KWOK profile of a GKE a4x (GB300) tray models it (Grace has up
    to 480 GB LPDDR5X each); 4 ConnectX-7 NICs per tray for the compute fabric."""
    cpu, memory_gi, storage_gi, pods = 144, 960, 7680, 110
    fields: dict[str, Any] = {
        "name": name,
        "cpu": str(cpu),
        "memory": f"{memory_gi}Gi",
        "ephemeral_storage": f"{storage_gi}Gi",
        "pods": pods,
        "allocatable": _allocatable(cpu, memory_gi, storage_gi, pods=pods),
        "arch": "arm64",
        "kernel": KERNEL_ARM64,
        "gpus": GB200.gpus_per_node,
        "gpu": GB200,
        "nvlink_clique": clique,
        "zone": zone,
        "rdma_devices": RDMA_HCA_MAX,
        "mellanox_nics": True,
        "numa_nodes": 2,
    }
    return FakeNode(**(fields | extra))


def l40s_node(name: str, *, gpus: int = 4, zone: str = "zone-a", **extra: Any) -> FakeNode:
    """A PCIe L40S server, e.g. AWS g6e.12xlarge: 4x L40S, 48 vCPU, 384 GiB (g6e.48xlarge: 8x,
    192 vCPU, 1536 GiB). No NVLink, no RDMA NIC, no MIG."""
    cpu, memory_gi, storage_gi, pods = 12 * gpus, 96 * gpus, 3800, 110
    fields: dict[str, Any] = {
        "name": name,
        "cpu": str(cpu),
        "memory": f"{memory_gi}Gi",
        "ephemeral_storage": f"{storage_gi}Gi",
        "pods": pods,
        "allocatable": _allocatable(cpu, memory_gi, storage_gi, pods=pods),
        "gpus": gpus,
        "gpu": L40S,
        "zone": zone,
    }
    return FakeNode(**(fields | extra))


def gpu_node(
    name: str,
    *,
    product: str = H200.product,
    clique: str | None = None,
    zone: str = "zone-a",
    **extra: Any,
) -> FakeNode:
    """A node of a known GPU product, with that product's real profile: HGX H200 by default.
    `clique` is only for products in a multi-node NVLink domain (GB200); asking for one on
    another product is refused, since no such node exists."""
    gpu = lookup(product)
    if gpu is None:
        raise ValueError(f"unknown GPU product {product!r}: add it to pdserve.api.gpu_products")
    if gpu.multi_node_nvlink:
        if clique is None:
            raise ValueError(f"{product} nodes carry {CLIQUE_LABEL}: pass clique=")
        return gb200_nvl72_node(name, clique=clique, zone=zone, **extra)
    if clique is not None:
        raise ValueError(f"{product} never carries {CLIQUE_LABEL} (its NVLink ends at the node)")
    profiles: dict[str, Callable[..., FakeNode]] = {
        H100_80GB_HBM3.product: hgx_h100_node,
        H200.product: hgx_h200_node,
        L40S.product: l40s_node,
    }
    return profiles[product](name, zone=zone, **extra)


def cpu_node(name: str, *, cpu: str = "16", memory: str = "64Gi", zone: str = "zone-a") -> FakeNode:
    return FakeNode(name=name, cpu=cpu, memory=memory, ephemeral_storage="200Gi", zone=zone)


# Two GB200 NVL72 cliques as GFD names them (<ClusterUUID>.<CliqueId>): one fabric, two cliques.
GB200_FABRIC = "7b968a6d-c8aa-45e1-9e07-e1e51be99c31"
CLIQUE_0 = f"{GB200_FABRIC}.0"
CLIQUE_1 = f"{GB200_FABRIC}.1"


def demo_nodes() -> list[FakeNode]:
    """A mixed GPU cluster: two HGX H200 nodes (each its own NVLink domain), two GB200 NVL72
    cliques of two compute trays each (8 GPUs per multi-node NVLink domain), one L40S server and
    two CPU nodes."""
    return [
        hgx_h200_node("h200-0"),
        hgx_h200_node("h200-1"),
        gb200_nvl72_node("gb200-c0-0", clique=CLIQUE_0),
        gb200_nvl72_node("gb200-c0-1", clique=CLIQUE_0),
        gb200_nvl72_node("gb200-c1-0", clique=CLIQUE_1),
        gb200_nvl72_node("gb200-c1-1", clique=CLIQUE_1),
        l40s_node("l40s-0"),
        cpu_node("cpu-0"),
        cpu_node("cpu-1"),
    ]


NVL72_TRAYS = 18
"""Compute trays per GB200 NVL72 rack: 72 GPUs, 4 per tray, one NVLink domain (one clique)."""
RACK_FABRIC = "3f1c9a2e-5b7d-4e08-a1c6-d2e4f6a8b0c1"


def nvl72_rack(prefix: str, *, clique: str = f"{RACK_FABRIC}.0") -> list[FakeNode]:
    """A whole GB200 NVL72 rack: its 18 compute trays in one clique (`make demo-wide-ep`)."""
    return [gb200_nvl72_node(f"{prefix}-{i:02d}", clique=clique) for i in range(NVL72_TRAYS)]


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


# What the node lifecycle controller taints a node with until it has seen it Ready: the
# scheduler skips a node that still carries one (TaintNodesByCondition).
CONDITION_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def node_ready(node: Mapping[str, Any]) -> bool:
    """Ready, and so to the scheduler too: the lifecycle controller has lifted its taints. A
    pod created between the two is unschedulable and backs off, and a pod created after it may
    take the node first (measured: the taint went 0.6 s after kwok reported Ready, and a
    group's worker, created 0.1 s after its leader, took the only tray)."""
    conditions = node.get("status", {}).get("conditions") or []
    taints = node.get("spec", {}).get("taints") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions) and not (
        any(t.get("key") in CONDITION_TAINTS for t in taints)
    )


def wait_nodes_ready(http: httpx.Client, names: Iterable[str], *, timeout: float = 60) -> None:
    pending = set(names)

    def all_ready() -> bool:
        for name in sorted(pending):
            response = http.get(f"/api/v1/nodes/{name}")
            if response.is_success and node_ready(response.json()):
                pending.discard(name)
        return not pending

    wait_until(f"nodes {sorted(pending)} to become Ready", all_ready, timeout=timeout)
