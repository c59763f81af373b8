"""Engine placement: GPU products, topology domains per slice, RDMA, Guaranteed QoS.

The terms pdserve derives are added to the user's `spec.placement.affinity`, never replacing it:
node selector terms are ORed by Kubernetes, so a required node expression joins every term."""

from __future__ import annotations

import copy
from typing import Any

from pdserve.api import DisaggregatedModel, EnginePoolSpec
from pdserve.api.gpu_products import PRODUCT_LABEL as GPU_PRODUCT_LABEL
from pdserve.api.placement import Strength
from pdserve.api.requirements import ResourceRequirements, guaranteed_resources
from pdserve.builders.leaderworkerset import group_affinity_term
from pdserve.builders.names import slice_labels
from pdserve.builders.pods import resources
from pdserve.contract.names import MODEL_LABEL, SLICE_LABEL, Component

MULTUS_NETWORKS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def _require_node_expression(affinity: dict[str, Any], expression: dict[str, Any]) -> None:
    required = affinity.setdefault("nodeAffinity", {}).setdefault(REQUIRED, {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        term.setdefault("matchExpressions", []).append(expression)


def _add_pod_term(
    affinity: dict[str, Any], kind: str, term: dict[str, Any], strength: Strength
) -> None:
    section = affinity.setdefault(kind, {})
    if strength is Strength.required:
        section.setdefault(REQUIRED, []).append(term)
    else:
        section.setdefault(PREFERRED, []).append({"weight": 100, "podAffinityTerm": term})


def engine_affinity(
    dm: DisaggregatedModel, slice_index: int, group: dict[str, str] | None = None
) -> dict[str, Any] | None:
    """The user's affinity plus: a GPU product requirement, every pod of the slice in one
    domain, and (optionally) other slices kept out of that domain. `group`: the selector of a
    multi-node pool, whose every LeaderWorkerSet group must share one domain."""
    placement = dm.spec.placement
    affinity: dict[str, Any] = copy.deepcopy(dict(placement.affinity or {}))
    if placement.gpu_products:
        _require_node_expression(
            affinity,
            {"key": GPU_PRODUCT_LABEL, "operator": "In", "values": list(placement.gpu_products)},
        )
    key = placement.group_topology_key
    if group is not None and key is not None:
        # Required whatever the slice's own domain mode: a group split across domains cannot
        # run its collectives over NVLink.
        _add_pod_term(affinity, "podAffinity", group_affinity_term(group, key), Strength.required)
    domain = placement.domain
    if domain is not None:
        together = {
            "labelSelector": {"matchLabels": slice_labels(dm, slice_index)},
            "topologyKey": domain.topology_key,
        }
        _add_pod_term(affinity, "podAffinity", together, domain.mode)
        if domain.spread_slices is not None and placement.slices > 1:
            others = {
                "labelSelector": {
                    "matchLabels": {MODEL_LABEL: dm.name},
                    "matchExpressions": [
                        {"key": SLICE_LABEL, "operator": "NotIn", "values": [str(slice_index)]}
                    ],
                },
                "topologyKey": domain.topology_key,
            }
            _add_pod_term(affinity, "podAntiAffinity", others, domain.spread_slices)
    return affinity or None


def engine_resources(
    dm: DisaggregatedModel, component: Component, pool: EnginePoolSpec
) -> dict[str, Any]:
    """CPU/memory as written, per-GPU requests where unset (equal requests and limits under
    Guaranteed QoS), the accelerator per tensor x data parallel rank, and the RDMA device."""
    placement = dm.spec.placement
    extended: dict[str, int] = {}
    if placement.accelerator_resource:
        extended[placement.accelerator_resource] = pool.gpus
    if placement.rdma is not None:
        extended[placement.rdma.resource] = placement.rdma.count
    spec = pool.effective_resources(bool(placement.accelerator_resource))
    if placement.wants_guaranteed_qos:
        both = guaranteed_resources(component.value, spec)
        spec = ResourceRequirements(
            requests={**spec.requests, **both}, limits={**spec.limits, **both}
        )
    out = resources(spec, extended)
    if placement.resource_claims:
        out["claims"] = [{"name": claim.name} for claim in placement.resource_claims]
    return out


def engine_pod_fields(dm: DisaggregatedModel) -> dict[str, Any]:
    """Pod spec fields of RDMA host networking and DRA resource claims."""
    placement = dm.spec.placement
    fields: dict[str, Any] = {}
    if placement.resource_claims:
        fields["resourceClaims"] = [claim.to_json() for claim in placement.resource_claims]
    return fields | host_network_fields(dm)


def host_network_fields(dm: DisaggregatedModel) -> dict[str, Any]:
    """Pod spec fields of RDMA host networking: the engines' and their nodes' probes'."""
    rdma = dm.spec.placement.rdma
    if rdma is not None and rdma.host_network:
        # Cluster DNS must keep working for the engine's own lookups (model hub, peers).
        return {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}
    return {}


def engine_pod_annotations(dm: DisaggregatedModel) -> dict[str, str]:
    rdma = dm.spec.placement.rdma
    if rdma is None or not rdma.networks:
        return {}
    return {MULTUS_NETWORKS_ANNOTATION: ",".join(rdma.networks)}


def engine_security_context(dm: DisaggregatedModel) -> dict[str, Any] | None:
    """RDMA registers (pins) memory for the NIC: the container needs IPC_LOCK, and only then."""
    if dm.spec.placement.rdma is None:
        return None
    return {"capabilities": {"add": ["IPC_LOCK"]}}
