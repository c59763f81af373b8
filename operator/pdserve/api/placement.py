"""`spec.placement`: where the GPU engine pools run: nodes, topology domains, slices, RDMA."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, model_validator

from pdserve.api.base import ApiModel, CrossFieldRule, with_rules
from pdserve.api.common import LabelMap, PreservedObject
from pdserve.api.gpu_products import CLIQUE_LABEL, PRODUCT_LABEL, lookup, never_in_a_clique
from pdserve.api.requirements import GPU_RESOURCE

LABEL_KEY = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
EXTENDED_RESOURCE = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
HOSTNAME_KEY = "kubernetes.io/hostname"


class Strength(StrEnum):
    required = "Required"
    preferred = "Preferred"


class TopologyDomainSpec(ApiModel):
    """Keep every engine pod of a slice (its prefill and decode replicas) inside one topology
    domain: the nodes sharing one value of a node label."""

    topology_key: Annotated[str, Field(pattern=LABEL_KEY, max_length=317)] = "nvidia.com/gpu.clique"
    """Node label whose value names the domain: nvidia.com/gpu.clique (a multi-node NVLink
    domain, which NVIDIA GPU feature discovery publishes only on GB200/GB300 NVL72 systems,
    never on HGX H100/H200), kubernetes.io/hostname (one node: the NVLink domain of HGX, KV over
    the NIC between pods), or a zone or rack label your nodes carry."""
    mode: Strength = Strength.required
    """Required: a slice's pods wait Pending rather than leave the domain (status condition
    Placement=False says why). Preferred: the scheduler may break the domain when it must."""
    spread_slices: Strength | None = None
    """Put different slices in different domains (pod anti-affinity): Required, Preferred, or
    unset for no spreading."""


class RdmaSpec(ApiModel):
    """RDMA for the KV transfer (NIXL over UCX): the NIC resource, networks and privileges."""

    resource: Annotated[str, Field(pattern=EXTENDED_RESOURCE, max_length=253)]
    """Extended resource of the RDMA device plugin each engine pod requests, e.g.
    rdma/rdma_shared_device_a (k8s-rdma-shared-dev-plugin) or nvidia.com/hostdev."""
    count: Annotated[int, Field(ge=1, le=64)] = 1
    """How many of `resource` each engine pod requests."""
    networks: list[Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        default_factory=list
    )
    """Multus secondary networks (NetworkAttachmentDefinition names, optionally
    namespace/name) attached to engine pods (annotation k8s.v1.cni.cncf.io/networks)."""
    host_network: bool = False
    """Run engine pods in the host network namespace (explicit opt-in: it exposes the engine
    ports on the node and allows one engine pod per node)."""


DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def _one_claim_source(claim: ResourceClaimSpec) -> str | None:
    template, name = claim.resource_claim_template_name, claim.resource_claim_name
    if (template is None) == (name is None):
        return "set exactly one of resourceClaimTemplateName and resourceClaimName"
    return None


ONE_CLAIM_SOURCE = CrossFieldRule(
    "has(self.resourceClaimTemplateName) != has(self.resourceClaimName)",
    "set exactly one of resourceClaimTemplateName and resourceClaimName",
    None,
    _one_claim_source,
)


class ResourceClaimSpec(ApiModel):
    """A Dynamic Resource Allocation claim every engine pod (and its vllm container) gets, e.g.
    the IMEX channel of an NVIDIA DRA ComputeDomain, without which GB200 NVL72 pods get no
    NVLink across trays."""

    model_config = with_rules([ONE_CLAIM_SOURCE])

    name: Annotated[str, Field(pattern=DNS_LABEL, max_length=63)]
    """The claim's name inside the pod (pod spec resourceClaims[].name)."""
    resource_claim_template_name: Annotated[str, Field(min_length=1, max_length=253)] | None = None
    """A ResourceClaimTemplate in the model's namespace: each pod gets its own claim (the
    ComputeDomain's channel template, e.g. <domain>-channel)."""
    resource_claim_name: Annotated[str, Field(min_length=1, max_length=253)] | None = None
    """An existing ResourceClaim every engine pod shares."""


def _slices_need_a_domain(placement: PlacementSpec) -> str | None:
    if placement.slices > 1 and placement.domain is None:
        return (
            f"slices is {placement.slices} but domain is unset: set "
            "placement.domain.topologyKey (e.g. nvidia.com/gpu.clique) to keep each slice in"
        )
    return None


SLICES_NEED_A_DOMAIN = CrossFieldRule(
    "!has(self.slices) || self.slices == 1 || has(self.domain)",
    "slices > 1 needs a domain (placement.domain.topologyKey) to keep each slice in",
    ".slices",
    _slices_need_a_domain,
)


def _host_network_splits_a_node_domain(placement: PlacementSpec) -> str | None:
    rdma, domain = placement.rdma, placement.domain
    if rdma is None or not rdma.host_network or domain is None:
        return None
    if domain.topology_key != HOSTNAME_KEY:
        return None
    return (
        "rdma.hostNetwork puts every engine on its node's ports (8000 and the NIXL side "
        f"channel), so a slice's prefill and decode can never share a node, yet "
        f"domain.topologyKey {HOSTNAME_KEY} requires it: use a domain of several nodes "
        "(a rack or zone label, or nvidia.com/gpu.clique on multi-node NVLink systems), or "
        "set rdma.hostNetwork false (Multus secondary networks carry RDMA without it)"
    )


HOST_NETWORK_SPLITS_A_NODE_DOMAIN = CrossFieldRule(
    "!has(self.rdma) || !has(self.rdma.hostNetwork) || !self.rdma.hostNetwork "
    "|| !has(self.domain) || !has(self.domain.topologyKey) "
    f"|| self.domain.topologyKey != '{HOSTNAME_KEY}'",
    "rdma.hostNetwork cannot share a node between a slice's prefill and decode (both claim "
    f"the same host ports): use a domain other than {HOSTNAME_KEY}, or hostNetwork false",
    ".rdma.hostNetwork",
    _host_network_splits_a_node_domain,
)


class PlacementSpec(ApiModel):
    """Where the GPU engine pools (prefill and decode) run; render and gateway pods have their
    own nodeSelector/tolerations."""

    model_config = with_rules([SLICES_NEED_A_DOMAIN, HOST_NETWORK_SPLITS_A_NODE_DOMAIN])

    node_selector: LabelMap = Field(default_factory=dict)
    """Node labels every engine pod requires (merged with <pool>.nodeSelector)."""
    tolerations: list[PreservedObject] = Field(default_factory=list)
    """Tolerations of every engine pod (added to <pool>.tolerations)."""
    affinity: PreservedObject | None = None
    """Node affinity and pod (anti-)affinity of every engine pod, as in a pod spec; the terms
    pdserve derives from gpuProducts and domain are added to it."""
    accelerator_resource: Annotated[
        str, Field(pattern=r"^([a-z0-9.-]+/[A-Za-z0-9._-]+)?$", max_length=253)
    ] = GPU_RESOURCE
    """Extended resource each engine pod requests tensorParallelSize x dataParallelSize of
    (e.g. amd.com/gpu). Empty: request none; the engines are taken to run on CPU (vLLM's CPU
    backend, or simulator pools in kind or CI), which sets the default serving.blockSize."""
    gpu_products: list[Annotated[str, Field(min_length=1, max_length=63)]] = Field(
        default_factory=list
    )
    """Allowed GPU models (node label nvidia.com/gpu.product, e.g. NVIDIA-H200): engine pods
    require a node with one of them. Empty: any."""
    domain: TopologyDomainSpec | None = None
    """Keep each slice's prefill and decode inside one topology domain. Unset: no co-location."""
    slices: Annotated[int, Field(ge=1, le=64)] = 1
    """Independent groups of prefill.replicas prefill and decode.replicas decode engines, each
    in its own domain and its own StatefulSets (<name>-prefill-s<n>, <name>-decode-s<n>,
    label pdserve.io/slice). Total engines = slices x replicas. Changing it replaces the engine
    StatefulSets."""
    rdma: RdmaSpec | None = None
    """RDMA for the KV transfer: NIC resource, Multus networks, IPC_LOCK, host network opt-in.
    Unset: no RDMA resources or privileges are requested."""
    resource_claims: list[ResourceClaimSpec] = Field(default_factory=list, max_length=16)
    """DRA resource claims of every engine pod and its vllm container (pod spec
    resourceClaims, container resources.claims): on GB200/GB300 NVL72 the IMEX channel of
    NVIDIA's DRA ComputeDomain, which cross-tray NVLink needs."""
    guaranteed_qos: Annotated[bool | None, Field(alias="guaranteedQoS")] = None
    """Give engine containers requests == limits for CPU and memory (Guaranteed QoS) so the
    kubelet's topology manager can align GPUs and NICs on one NUMA node. Default: on when rdma
    is set. Uses cpu and memory of <pool>.resources, on GPUs their per-GPU defaults where
    unset; CPU engines need both set."""

    @model_validator(mode="after")
    def _clique_only_where_nodes_carry_it(self) -> PlacementSpec:
        # Python only: which products carry the label is the catalogue's to say, not CEL's.
        domain = self.domain
        if domain is None or domain.topology_key != CLIQUE_LABEL:
            return self
        if domain.mode is not Strength.required:
            return self
        never = [p for p in self.products if never_in_a_clique(p)]
        if never:
            raise ValueError(
                f"placement.domain.topologyKey {CLIQUE_LABEL} (mode Required) on "
                f"{', '.join(never)}: GPU Feature Discovery sets that label only on multi-node "
                "NVLink systems (GB200/GB300 NVL72), never on these nodes, so every engine pod "
                "would stay Pending. Use topologyKey kubernetes.io/hostname (on HGX the NVLink "
                "domain is one node), or take these products out of placement.gpuProducts"
            )
        return self

    @property
    def products(self) -> list[str]:
        """The GPU products the engines may land on, as far as placement says: gpuProducts,
        or the product its nodeSelector requires. Empty: any."""
        chosen = self.node_selector.get(PRODUCT_LABEL)
        if self.gpu_products:
            return [p for p in self.gpu_products if chosen is None or p == chosen]
        return [chosen] if chosen is not None else []

    @property
    def group_topology_key(self) -> str | None:
        """The domain each group of a multi-node pool (nodesPerReplica > 1) must stay in:
        domain's key, else the NVLink clique when every allowed product is a multi-node NVLink
        system (GB200/GB300 NVL72, where GPU Feature Discovery always publishes it), else none
        (groups talk over RDMA or the pod network)."""
        if self.domain is not None:
            return self.domain.topology_key
        products = [lookup(p) for p in self.products]
        if products and all(p is not None and p.multi_node_nvlink for p in products):
            return CLIQUE_LABEL
        return None

    @property
    def engines_on_cpu(self) -> bool:
        """The engines request no accelerator, so vLLM runs them on its CPU backend."""
        return not self.accelerator_resource

    @property
    def wants_guaranteed_qos(self) -> bool:
        return self.rdma is not None if self.guaranteed_qos is None else self.guaranteed_qos
