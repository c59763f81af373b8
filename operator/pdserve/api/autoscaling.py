"""Autoscaling specs: the shared scaling behaviour, engine pools (Builtin or External) and the
render pool (HPA, KEDA or Builtin)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from pdserve.api.base import ApiModel, CrossFieldRule, with_rules


def _bounds(scaling: ScalingBehaviour) -> str | None:
    if scaling.max_replicas < scaling.min_replicas:
        return (
            f"maxReplicas ({scaling.max_replicas}) must be >= minReplicas ({scaling.min_replicas})"
        )
    return None


# Subclasses that add rules replace the parent's list: each repeats this one.
MIN_MAX_REPLICAS = CrossFieldRule(
    "!has(self.maxReplicas) || !has(self.minReplicas) || self.maxReplicas >= self.minReplicas",
    "maxReplicas must be >= minReplicas",
    ".maxReplicas",
    _bounds,
)


class ScalingBehaviour(ApiModel):
    """How fast an autoscaler may move: bounds, stabilization windows against flapping, steps
    and cooldowns. The same semantics for every engine (the HPA/KEDA behaviour fields are derived
    from them; the Builtin engine applies them itself)."""

    model_config = with_rules([MIN_MAX_REPLICAS])

    min_replicas: Annotated[int, Field(ge=1, le=1000)] = 1
    """Fewest replicas."""
    max_replicas: Annotated[int, Field(ge=1, le=1000)] = 4
    """Most replicas."""
    scale_up_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = 0
    """A scale-up follows the lowest recommendation of this window (a short spike does not
    add replicas)."""
    scale_down_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = 300
    """A scale-down follows the highest recommendation of this window (load must stay low this
    long before replicas go)."""
    scale_up_step: Annotated[int, Field(ge=1, le=1000)] = 4
    """Most replicas added in one step."""
    scale_down_step: Annotated[int, Field(ge=1, le=1000)] = 1
    """Most replicas removed in one step."""
    cooldown_seconds: Annotated[int, Field(ge=0, le=1800)] = 30
    """After a step, no further step in the same direction for this long (the HPA policy's
    periodSeconds)."""


class EngineAutoscaler(StrEnum):
    builtin = "Builtin"
    external = "External"


class EngineAutoscalingSpec(ScalingBehaviour):
    """SLO-driven autoscaling of an engine pool. Builtin: the operator scrapes the engines and
    sets the StatefulSets' replicas (prefill from queued prompt tokens and measured prefill
    throughput against the TTFT SLO; decode from KV-cache use and ITL against the ITL SLO; with
    placement.slices > 1 whole slices, so P:D and the topology domain hold). External: your
    HPA or KEDA ScaledObject drives the StatefulSet's /scale; the operator never sets its
    replicas."""

    engine: EngineAutoscaler = EngineAutoscaler.builtin
    """Builtin (the operator) or External (an HPA/KEDA targeting the StatefulSet
    <name>-prefill or <name>-decode, or the LeaderWorkerSet of that name when nodesPerReplica
    > 1, whose /scale counts groups; one slice only)."""
    min_replicas: Annotated[int, Field(ge=1, le=1024)] = 1
    """Fewest engine replicas of the pool (all slices together): pods, or groups of pods with
    nodesPerReplica > 1."""
    max_replicas: Annotated[int, Field(ge=1, le=1024)] = 4
    """Most engine replicas of the pool (all slices together): pods, or groups of pods with
    nodesPerReplica > 1."""
    target_utilization_percent: Annotated[int, Field(ge=10, le=100)] = 80
    """prefill: share of the measured prefill throughput (prompt tokens per busy second) the
    pool may be loaded to; decode: KV-cache usage the pool aims for."""
    scale_up_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = 60
    """A scale-up follows the lowest recommendation of this window (GPU pods are expensive:
    load must stay high this long)."""
    scale_down_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = 600
    """A scale-down follows the highest recommendation of this window."""
    scale_up_step: Annotated[int, Field(ge=1, le=1024)] = 1
    """Most replicas (or slices) added in one step."""
    scale_down_step: Annotated[int, Field(ge=1, le=1024)] = 1
    """Most replicas (or slices) removed in one step."""
    cooldown_seconds: Annotated[int, Field(ge=0, le=1800)] = 300
    """After a step, no further step in the same direction for this long (engines load weights
    for minutes before they take load)."""


class RenderAutoscaler(StrEnum):
    hpa = "HPA"
    keda = "KEDA"
    builtin = "Builtin"


def _keda_needs_prometheus(scaling: RenderAutoscalingSpec) -> str | None:
    if scaling.engine is RenderAutoscaler.keda and scaling.prometheus_address is None:
        return (
            "render.autoscaling.engine KEDA needs render.autoscaling.prometheusAddress (the "
            "Prometheus its trigger queries, e.g. http://prometheus-operated.monitoring.svc"
            ":9090), or use engine HPA or Builtin"
        )
    return None


KEDA_NEEDS_PROMETHEUS = CrossFieldRule(
    "!has(self.engine) || self.engine != 'KEDA' || has(self.prometheusAddress)",
    "engine KEDA needs prometheusAddress (the Prometheus its trigger queries)",
    ".prometheusAddress",
    _keda_needs_prometheus,
)


class RenderAutoscalingSpec(ScalingBehaviour):
    """Autoscaling of the render pool on parser load: busy seconds per second of the render
    servers' render/derender handlers (their http_request_duration_seconds, and the gateway's
    own per-replica derender timing) per worker, with CPU utilization as the floor signal."""

    model_config = with_rules([MIN_MAX_REPLICAS, KEDA_NEEDS_PROMETHEUS])

    enabled: bool = True
    """Autoscale the render pool and leave the Deployment's replicas to the autoscaler."""
    engine: RenderAutoscaler = RenderAutoscaler.hpa
    """HPA: an autoscaling/v2 HorizontalPodAutoscaler on CPU plus the Pods metric
    pdserve_render_parser_busy (served by the Prometheus Adapter rule the chart ships). KEDA: a
    keda.sh ScaledObject with a Prometheus and a CPU trigger. Builtin: the operator scrapes the
    render pods and gateways itself and sets replicas (clusters with neither adapter)."""
    target_cpu_utilization_percentage: Annotated[
        int, Field(ge=1, le=100, alias="targetCPUUtilizationPercentage")
    ] = 70
    """Average CPU utilization (of the CPU request) aimed for: the floor signal."""
    target_parser_busy_percent: Annotated[int, Field(ge=10, le=100)] = 70
    """Busy seconds per second of render/derender work per worker aimed for (100: every worker
    always busy). Over it, derender calls queue and streamed tokens stall."""
    prometheus_address: Annotated[str, Field(pattern=r"^https?://.+")] | None = None
    """Prometheus URL the KEDA trigger queries, e.g.
    http://prometheus-operated.monitoring.svc:9090 (engine KEDA)."""
