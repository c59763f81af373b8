"""`DisaggregatedModel.status`: written only by the operator."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field

from pdserve.api.base import ApiModel


class ConditionType(StrEnum):
    ready = "Ready"
    available = "Available"
    progressing = "Progressing"
    config_parity = "ConfigParity"
    degraded = "Degraded"
    placement = "Placement"
    transport_verified = "TransportVerified"
    transport_healthy = "TransportHealthy"
    kv_policy = "KVPolicy"
    contract_verified = "ContractVerified"


class Condition(ApiModel):
    """A standard Kubernetes condition."""

    type: str
    """Condition type: Ready, Progressing, ConfigParity, Degraded, ..."""
    status: Literal["True", "False", "Unknown"]
    """True, False or Unknown."""
    reason: Annotated[str, Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")]
    """One CamelCase word saying why."""
    message: str = ""
    """What happened, for humans."""
    last_transition_time: str
    """When status last changed (RFC 3339)."""
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    """The metadata.generation this condition was computed for."""


class Phase(StrEnum):
    pending = "Pending"
    progressing = "Progressing"
    ready = "Ready"
    degraded = "Degraded"
    failed = "Failed"


class PoolStatus(ApiModel):
    """Replica counts of one pool."""

    desired: Annotated[int, Field(ge=0)] = 0
    """Replicas the pool should have (the HPA's choice for render); groups of pods for a pool
    whose replicas span nodes (nodesPerReplica > 1)."""
    ready: Annotated[int, Field(ge=0)] = 0
    """Replicas that are ready; for a multi-node pool, groups whose every pod is Ready."""
    summary: str = "0/0"
    """ready/desired, for printer columns ("1/2 groups" for a multi-node pool)."""


class PoolsStatus(ApiModel):
    """Replica counts per pool."""

    prefill: PoolStatus | None = None
    """Prefill pool; absent when serving is aggregated."""
    decode: PoolStatus = Field(default_factory=PoolStatus)
    """Decode pool."""
    render: PoolStatus | None = None
    """Render pool; absent when disabled."""
    gateway: PoolStatus = Field(default_factory=PoolStatus)
    """Gateway."""


class SliceTransport(ApiModel):
    """The preflight verdict on one slice's KV paths: the worst of its node pairs' (every node
    holding one of its engines is probed, each against the first prefill or decode pod's
    node)."""

    slice: Annotated[int, Field(ge=0)]
    """Slice index (0 when the model has one slice)."""
    verified: bool | None = None
    """True: the probe moved data over the expected transport; False: it did not (reason
    says why); unset: the probe has not reported yet."""
    reason: str
    """Verified, Probing, TCPFallback, NoRDMADevice, RDMALinkDown, DataCorrupted,
    ProbeFailed, ProbeUnschedulable (a probe pod cannot be scheduled: no verdict; the probe
    runs again) or WaitingForPlacement."""
    message: str = ""
    """What the probe saw, for humans; with several node pairs it names the pair reported
    (the failed one, or the slowest) and how many there are."""
    nodes: list[str] = Field(default_factory=list)
    """The nodes probed: every node of the slice when Verified, else the reported pair's."""
    transport: str | None = None
    """Transport class that carried the probe's NIXL READ: rdma, tcp, shm, cuda_ipc."""
    read_path: list[str] = Field(default_factory=list)
    """UCX lanes of the READ, e.g. rc_mlx5/mlx5_0:1 or tcp/eth0."""
    bandwidth_g_bps: float | None = Field(default=None, alias="bandwidthGBps")
    """Measured bandwidth, GB/s (the slowest pair's)."""
    latency_ms: float | None = None
    """Median time of one probe transfer, milliseconds."""
    job: str | None = None
    """The preflight Job of the reported node pair."""


class DisaggregatedModelStatus(ApiModel):
    """What the operator observed."""

    observed_generation: Annotated[int, Field(ge=0)] | None = None
    """The metadata.generation last reconciled."""
    phase: Phase = Phase.pending
    """Pending, Progressing, Ready, Degraded or Failed."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready, Progressing, ConfigParity, Degraded, ..."""
    pools: PoolsStatus = Field(default_factory=PoolsStatus)
    """Replica counts per pool."""
    parity_hash: str | None = None
    """Hash of the parity set stamped on every pod (pdserve.io/parity-hash)."""
    endpoint: str | None = None
    """In-cluster URL of the OpenAI API."""
    transport: list[SliceTransport] = Field(default_factory=list)
    """KV transport preflight per slice (spec.kvTransfer.verify)."""
