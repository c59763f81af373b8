"""Admission warnings: what a spec allows but a user should hear about before pods exist (kubectl
prints them; the operator logs them). Refusals live beside the fields they judge."""

from __future__ import annotations

from pdserve.api.fit import fit_warnings, hf_cache_gib
from pdserve.api.gpu_products import CLIQUE_LABEL, lookup
from pdserve.api.placement import Strength
from pdserve.api.spec import DisaggregatedModelSpec


def _one_nic_for_many_gpus(spec: DisaggregatedModelSpec) -> list[str]:
    devices = spec.kv_transfer.ucx_net_devices
    if devices is None or devices == "all" or "," in devices or spec.placement.rdma is None:
        return []
    return [
        f"spec.kvTransfer.ucxNetDevices {devices} sends the KV of all {pool.gpus} GPUs of each "
        f"spec.{name} pod through one NIC (UCX_NET_DEVICES applies to every rank; on 8-NIC HGX "
        "nodes each GPU has its own) and under SR-IOV the name inside the pod differs from the "
        "host's: leave it unset (UCX picks the NIC nearest each GPU) or list every NIC"
        for name, pool in spec.engine_pools()
        if pool.gpus > 1
    ]


def _spanning_groups(spec: DisaggregatedModelSpec) -> list[str]:
    """Groups with no domain to stay in talk between nodes over whatever network they get."""
    if spec.placement.group_topology_key is not None or spec.placement.rdma is not None:
        return []
    return [
        f"spec.{name}.nodesPerReplica {pool.nodes_per_replica}: a group's pods may land on any "
        "nodes, and its data-parallel coordination and expert all-to-all cross them over the "
        "pod network (no spec.placement.rdma): set spec.placement.rdma, and "
        "spec.placement.domain.topologyKey to keep each group in one rack or NVLink domain"
        for name, pool in spec.engine_pools()
        if pool.multi_node and not spec.placement.engines_on_cpu
    ]


def _clique_domain(spec: DisaggregatedModelSpec) -> list[str]:
    domain = spec.placement.domain
    spanning = any(pool.multi_node for _, pool in spec.engine_pools())
    if spanning and spec.placement.group_topology_key == CLIQUE_LABEL and domain is None:
        if spec.placement.resource_claims:
            return []
        return [
            "spec.placement: the groups of nodesPerReplica > 1 stay in one NVLink clique, but "
            "NVLink between trays also needs IMEX channels, which pods get only through a DRA "
            "ComputeDomain resource claim (NVIDIA's DRA driver): add it to "
            "spec.placement.resourceClaims, or the group's traffic moves over the NIC"
        ]
    if domain is None or domain.topology_key != CLIQUE_LABEL:
        return []
    products = [lookup(p) for p in spec.placement.products]
    if not products:
        strength = "wait Pending" if domain.mode is Strength.required else "ignore the domain"
        return [
            f"spec.placement.domain.topologyKey {CLIQUE_LABEL}: GPU Feature Discovery publishes "
            "it only on multi-node NVLink systems (GB200/GB300 NVL72); on HGX H100/H200 nodes "
            f"engine pods would {strength}. Use kubernetes.io/hostname there, or set "
            "spec.placement.gpuProducts so pdserve can check"
        ]
    if any(p is not None and p.multi_node_nvlink for p in products) and not (
        spec.placement.resource_claims
    ):
        return [
            "spec.placement.domain: NVLink between trays of a clique also needs IMEX channels, "
            "which pods get only through a DRA ComputeDomain resource claim (NVIDIA's DRA "
            "driver): add it to spec.placement.resourceClaims, or KV between trays moves over "
            "the NIC"
        ]
    return []


def _unsized_download(spec: DisaggregatedModelSpec) -> list[str]:
    if spec.model.source.pvc is not None or spec.placement.engines_on_cpu:
        return []
    if hf_cache_gib(spec) is not None:
        return []
    return [
        f"spec.model.source: {spec.model.name} downloads from the Hugging Face Hub into an "
        "unsized emptyDir on every engine pod start, and pdserve does not know its size: set "
        "spec.model.shape (pdserve then sizes the volume and requests the node disk), or load "
        "it from spec.model.source.pvc"
    ]


def _claims_take_whole_nodes(spec: DisaggregatedModelSpec) -> list[str]:
    """NVIDIA's DRA driver publishes one IMEX channel per node (channel-0 in its ResourceSlice),
    so only one pod per node can hold a ComputeDomain channel claim (kubernetes-sigs/
    dra-driver-nvidia-gpu#309, #353)."""
    if not spec.placement.resource_claims:
        return []
    products = [p for p in map(lookup, spec.placement.products) if p is not None]
    return [
        f"spec.{name}: {pool.gpus} GPUs per pod on {product.product} nodes of "
        f"{product.gpus_per_node}: with a ComputeDomain channel claim "
        "(spec.placement.resourceClaims) only one pod per node is allocated (one IMEX channel "
        f"per node), so {product.gpus_per_node - pool.gpus} GPUs of each node stay idle; use "
        f"tensorParallelSize x dataParallelSize = {product.gpus_per_node}"
        for name, pool in spec.engine_pools()
        for product in products
        if product.multi_node_nvlink and pool.gpus < product.gpus_per_node
    ]


def admission_warnings(spec: DisaggregatedModelSpec) -> list[str]:
    return [
        *fit_warnings(spec),
        *_one_nic_for_many_gpus(spec),
        *_clique_domain(spec),
        *_spanning_groups(spec),
        *_unsized_download(spec),
        *_claims_take_whole_nodes(spec),
    ]
