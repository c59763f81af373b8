"""GPU products as NVIDIA GPU Feature Discovery (GFD) labels them on a node.

GFD writes `nvidia.com/gpu.product` from NVML's device name with every character outside
`[A-Za-z0-9-_. ]` dropped and each run of blanks turned into one `-` ("NVIDIA H100 80GB HBM3" ->
`NVIDIA-H100-80GB-HBM3`), and `nvidia.com/gpu.memory` from NVML's total memory in MiB, the value
`nvidia-smi` prints as "xxxxxMiB" (NVIDIA/k8s-device-plugin `internal/lm/resource.go`
getProductName/sanitise, `internal/resource/nvml-device.go` GetTotalMemoryMiB). It writes
`nvidia.com/gpu.clique` (`<fabric ClusterUUID>.<CliqueId>`) only when a GPU is attached to an
NVLink fabric whose state is COMPLETED with a non-zero cluster UUID (`internal/lm/imex.go`, go-nvlib
`IsFabricAttached`): multi-node NVLink systems such as GB200 NVL72. HGX H100/H200 boards, whose
NVLink ends at the node, and PCIe cards never carry it.

The operator uses this catalogue to refuse a `nvidia.com/gpu.clique` domain on products that never
carry the label, and to check that weights plus KV cache fit a product's memory. Pure data, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final

PRODUCT_LABEL: Final = "nvidia.com/gpu.product"
MEMORY_LABEL: Final = "nvidia.com/gpu.memory"
CLIQUE_LABEL: Final = "nvidia.com/gpu.clique"


class GpuFamily(StrEnum):
    """`nvidia.com/gpu.family`, from the compute capability (k8s-device-plugin getArchFamily:
    8.9 -> ada-lovelace, 9.x -> hopper, 10.x and 12.x -> blackwell)."""

    ada_lovelace = "ada-lovelace"
    hopper = "hopper"
    blackwell = "blackwell"


@dataclass(frozen=True, slots=True)
class GpuProduct:
    """One GPU product as a node running GFD describes it."""

    product: str
    """`nvidia.com/gpu.product`, exactly as GFD writes it."""
    memory_mib: int
    """`nvidia.com/gpu.memory`: NVML total memory in MiB (what nvidia-smi shows)."""
    family: GpuFamily
    compute_major: int
    compute_minor: int
    multi_node_nvlink: bool
    """True when nodes with this GPU can sit in a multi-node NVLink domain and so carry
    `nvidia.com/gpu.clique`; False means the label never appears on such a node."""
    gpus_per_node: int
    """The usual count per node (server or compute tray): `nvidia.com/gpu.count`."""
    fixed_gpus_per_node: bool
    """True when every node with this product has exactly gpus_per_node (an HGX board, a
    GB200 tray); False for PCIe cards, whose servers hold different counts."""
    source: str
    """Where the values were read."""

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 1024 * 1024


H100_80GB_HBM3: Final = GpuProduct(
    product="NVIDIA-H100-80GB-HBM3",
    memory_mib=81559,
    family=GpuFamily.hopper,
    compute_major=9,
    compute_minor=0,
    multi_node_nvlink=False,
    gpus_per_node=8,
    fixed_gpus_per_node=True,
    source=(
        "GFD labels of an 8x H100 SXM node: gpu.product=NVIDIA-H100-80GB-HBM3, "
        "gpu.memory=81559, gpu.compute.major=9/minor=0, gpu.family=hopper (Lambda docs, KubeAI "
        "on an 8x H100 instance); nvidia-smi H100 81559MiB (modal-labs/modal-client#2797); "
        "8 GPUs: NVIDIA DGX H100 user guide"
    ),
)
H200: Final = GpuProduct(
    product="NVIDIA-H200",
    memory_mib=143771,
    family=GpuFamily.hopper,
    compute_major=9,
    compute_minor=0,
    multi_node_nvlink=False,
    gpus_per_node=8,
    fixed_gpus_per_node=True,
    source=(
        "nvidia-smi on HGX/DGX H200 prints 'NVIDIA H200' and 143771MiB (many public logs), "
        "which GFD sanitises to NVIDIA-H200; lspci 'GH100 [H200 SXM 141GB]' x8 "
        "(easydiffusion/torchruntime#24); the H200 NVL PCIe card is NVIDIA-H200-NVL, not this"
    ),
)
GB200: Final = GpuProduct(
    product="NVIDIA-GB200",
    memory_mib=189471,
    family=GpuFamily.blackwell,
    compute_major=10,
    compute_minor=0,
    multi_node_nvlink=True,
    gpus_per_node=4,
    fixed_gpus_per_node=True,
    source=(
        "nvidia-smi on GB200 NVL72 trays prints 'NVIDIA GB200' and 189471MiB (several public "
        "logs); nodeSelector nvidia.com/gpu.product=NVIDIA-GB200 in ai-dynamo recipes; 4 GPUs and "
        "compute capability 10.0 per tray (sgl-project/sglang#11208); clique: imex.go"
    ),
)
L40S: Final = GpuProduct(
    product="NVIDIA-L40S",
    memory_mib=46068,
    family=GpuFamily.ada_lovelace,
    compute_major=8,
    compute_minor=9,
    multi_node_nvlink=False,
    gpus_per_node=4,
    fixed_gpus_per_node=False,
    source=(
        "GFD labels of an L40S node: gpu.product=NVIDIA-L40S, gpu.memory=46068, "
        "mig.capable=false (OpenNebula OneKS GPU guide); nvidia-smi L40S 46068MiB "
        "(modal-labs/modal-client#2797); 4 per node as on AWS g6e.12xlarge (8 on g6e.48xlarge)"
    ),
)

CATALOGUE: Final = MappingProxyType({p.product: p for p in (H100_80GB_HBM3, H200, GB200, L40S)})
"""Every known product, by its `nvidia.com/gpu.product` value."""


def lookup(product: str) -> GpuProduct | None:
    """The catalogue entry for a `nvidia.com/gpu.product` value, or None if unknown."""
    return CATALOGUE.get(product)


def never_in_a_clique(product: str) -> bool:
    """True when nodes with this product never carry `nvidia.com/gpu.clique` (an unknown
    product is not judged)."""
    known = lookup(product)
    return known is not None and not known.multi_node_nvlink
