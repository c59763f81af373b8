"""`spec.gateway`: the OpenAI-compatible gateway in front of the pools."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, field_validator

from pdserve.api.base import ApiModel
from pdserve.api.common import LabelMap, PreservedObject, SecretKeyRef
from pdserve.api.overrides import PodOverrides
from pdserve.api.requirements import ResourceRequirements


class RoutingMode(StrEnum):
    auto = "Auto"
    disaggregated = "Disaggregated"
    aggregated = "Aggregated"


class SloSpec(ApiModel):
    """Latency objectives the gateway routes for (Auto mode) and reports against."""

    ttft_ms: Annotated[int, Field(ge=1)] | None = None
    """Time to first token, milliseconds."""
    itl_ms: Annotated[int, Field(ge=1)] | None = None
    """Inter-token latency, milliseconds."""


class RoutingSpec(ApiModel):
    """How the gateway sends requests."""

    mode: RoutingMode = RoutingMode.auto
    """Auto: per request, prefill on the prefill pool or locally on decode, by SLO and load.
    Disaggregated: always prefill then decode. Aggregated: decode pool only."""


class GatewaySpec(ApiModel):
    """The OpenAI-compatible gateway in front of the pools."""

    replicas: Annotated[int, Field(ge=1, le=100)] = 2
    """Gateway replicas. Two or more share the long-prefill limit by holding slots on each
    other with a peer key, which the operator derives into the Secret <name>-gateway-peer-key,
    owned by the model (one replica gets none without apiKeySecretRef)."""
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    """Port of the gateway Service."""
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Type of the gateway Service."""
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    """Routing policy."""
    slo: SloSpec = Field(default_factory=SloSpec)
    """Latency objectives."""
    api_key_secret_ref: SecretKeyRef | None = None
    """Secret key holding the API key clients must send as a Bearer token. With it, the
    operator also gives the gateway replicas a peer key of their own for each other's admission
    endpoints: derived from the operator's master key into the Secret <name>-gateway-peer-key,
    owned by the model."""
    resources: ResourceRequirements = Field(
        default_factory=lambda: ResourceRequirements(
            requests={"cpu": "250m", "memory": "256Mi"}, limits={"memory": "1Gi"}
        )
    )
    """CPU and memory of the gateway container."""
    node_selector: LabelMap = Field(default_factory=dict)
    """Node labels the gateway pods require."""
    tolerations: list[PreservedObject] = Field(default_factory=list)
    """Tolerations of the gateway pods."""
    pod_overrides: PodOverrides = Field(default_factory=PodOverrides)
    """Pod fields of the cluster's own, merged onto the gateway pods (all of a pool's
    podOverrides but serviceAccountName: the gateway's ServiceAccount is pdserve's, with the
    rights its discovery needs)."""
    service_annotations: LabelMap = Field(default_factory=dict)
    """Annotations on the gateway Service (an internal load balancer, external-dns)."""

    @field_validator("pod_overrides")
    @classmethod
    def _own_service_account(cls, overrides: PodOverrides) -> PodOverrides:
        if overrides.service_account_name is not None:
            raise ValueError(
                "serviceAccountName: the gateway runs as the ServiceAccount pdserve creates "
                "(<name>-gateway, with the rights its pod discovery needs); remove it"
            )
        return overrides

    request_timeout_seconds: Annotated[int, Field(ge=1, le=86400)] = 600
    """Longest a whole request may take, from its first byte to its last (a non-streamed
    answer is bounded by this alone): then 504, or an error event in a stream. Raise it for
    long generations (reasoning models, large max_tokens); the engines' own drain on a
    rollout (<pool>.shutdownTimeoutSeconds) is separate."""
    endpoint_wait_seconds: Annotated[int, Field(ge=0, le=3600)] | None = None
    """Longest a request waits for a pool it needs to have a ready replica (render, decode,
    and prefill in routing mode Disaggregated) before it gets 503. A pool of one replica has
    none while its pod restarts on a rollout: set this to the engines' start time (model load
    included) and such a rollout fails no request, each held at most this long (and within
    requestTimeoutSeconds). Default: 30."""
    request_log: bool = False
    """Write one JSON line per finished request to the gateway's log (`kubectl logs`): the
    render, prefill and decode pods that served it, their parity hash, timings and token
    counts. Off by default: a line per request costs CPU at high rates."""
    replica_check: Literal["Enforce", "Off"] = "Enforce"
    """Enforce: each gateway checks every render and engine replica before it takes traffic (a
    canary render, tokenize and derender on render; vLLM version and served model on engines)
    and keeps out of routing any replica that disagrees with the rest of its group, naming the
    fields that differ (`/status`, an Event on the pod). Off: no checks (every ready replica
    is routed at once)."""
