"""Who owns each pool's replicas, and how many the builders write.

Never fight an autoscaler for replicas: with an HPA, a KEDA ScaledObject or an External engine
autoscaler the workload's `replicas` is left out of what pdserve applies (the autoscaler writes
it through the /scale subresource). With the Builtin engine the operator itself is the
autoscaler: the count comes in as a `ReplicaPlan` (what the live objects hold, or what the
operator's loop decided), always inside the spec's bounds, so an apply writes only when the
decision changes."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.api import DisaggregatedModel, EnginePoolSpec
from pdserve.api.autoscaling import EngineAutoscaler, RenderAutoscaler, ScalingBehaviour
from pdserve.contract.metrics import GATEWAY_RENDER_CALL_SECONDS_SUM
from pdserve.contract.names import Component

# The custom metrics the Prometheus Adapter rule (charts/pdserve) serves per render pod, and
# the series behind them. vLLM's API servers (render included) expose
# prometheus-fastapi-instrumentator's http_request_duration_seconds{handler, method}.
PARSER_BUSY_METRIC = "pdserve_render_parser_busy"
GATEWAY_BUSY_METRIC = "pdserve_render_gateway_busy"
RENDER_HANDLERS = "/v1/(chat/)?completions/(de)?render"
SERVER_DURATION_SERIES = "http_request_duration_seconds_sum"
GATEWAY_DURATION_SERIES = GATEWAY_RENDER_CALL_SECONDS_SUM


@dataclass(frozen=True)
class ReplicaPlan:
    """Replica counts of Builtin-autoscaled pools: what the live objects hold or what the
    operator's loop decided. None: the spec's starting count. Values outside the spec's bounds
    are clamped into them."""

    render: int | None = None
    prefill: int | None = None
    decode: int | None = None
    slices: int | None = None  # active slices, with placement.slices > 1


def clamp(value: int, bounds: ScalingBehaviour) -> int:
    return max(bounds.min_replicas, min(bounds.max_replicas, value))


def render_replicas(dm: DisaggregatedModel, plan: ReplicaPlan | None) -> int | None:
    """The render Deployment's replicas; None when an HPA/KEDA owns them."""
    render = dm.spec.render
    scaling = render.autoscaling
    if not scaling.enabled:
        return render.replicas
    if scaling.engine is not RenderAutoscaler.builtin:
        return None
    chosen = plan.render if plan is not None else None
    return clamp(scaling.min_replicas if chosen is None else chosen, scaling)


def builtin_slices(dm: DisaggregatedModel) -> bool:
    """True when the Builtin loop scales whole slices (placement.slices > 1, engines
    autoscaled; the API refuses anything but Builtin on every pool then)."""
    return dm.spec.placement.slices > 1 and any(
        pool.autoscaling is not None for _, pool in dm.spec.engine_pools()
    )


def active_slices(dm: DisaggregatedModel, plan: ReplicaPlan | None) -> int:
    low, high = dm.spec.slice_bounds()
    chosen = plan.slices if plan is not None else None
    return max(low, min(high, low if chosen is None else chosen))


def engine_replicas(
    dm: DisaggregatedModel,
    component: Component,
    pool: EnginePoolSpec,
    slice_index: int,
    plan: ReplicaPlan | None,
) -> int | None:
    """One engine StatefulSet's replicas; None when an External autoscaler owns them. With
    slices, the first `active_slices` slices run the pool's per-slice replicas (the P:D ratio)
    and the rest stand at 0, each kept in its own topology domain."""
    scaling = pool.autoscaling
    if scaling is None:
        return pool.replicas
    if scaling.engine is EngineAutoscaler.external:
        return None
    if builtin_slices(dm):
        return pool.replicas if slice_index < active_slices(dm, plan) else 0
    chosen = getattr(plan, component.value) if plan is not None else None
    return clamp(pool.replicas if chosen is None else chosen, scaling)


def hpa_behavior(scaling: ScalingBehaviour) -> dict[str, object]:
    """autoscaling/v2 behavior from the shared fields (policy periods are 1-1800 s)."""
    period = max(1, min(1800, scaling.cooldown_seconds))
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": scaling.scale_up_stabilization_seconds,
            "selectPolicy": "Max",
            "policies": [{"type": "Pods", "value": scaling.scale_up_step, "periodSeconds": period}],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": scaling.scale_down_stabilization_seconds,
            "selectPolicy": "Max",
            "policies": [
                {"type": "Pods", "value": scaling.scale_down_step, "periodSeconds": period}
            ],
        },
    }
