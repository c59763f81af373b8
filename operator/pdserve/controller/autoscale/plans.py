"""The replica counts of Builtin-scaled pools: what the live objects hold (the cluster is the
autoscaler's memory, so a restarted operator resumes from it) and what the builders write for a
plan (clamped into the bounds)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.api.autoscaling import EngineAutoscaler, RenderAutoscaler
from pdserve.builders.leaderworkerset import pod_template_of
from pdserve.builders.scaling import (
    ReplicaPlan,
    active_slices,
    builtin_slices,
    render_replicas,
)
from pdserve.contract.names import COMPONENT_LABEL, SLICE_LABEL

POOLS = ("render", "prefill", "decode", "slices")


def live_plan(dm: DisaggregatedModel, workloads: Iterable[Mapping[str, Any]]) -> ReplicaPlan:
    """The replica counts the live objects hold for Builtin-scaled pools (restart-safe: the
    cluster is the memory). Active slices: those whose StatefulSets run pods."""
    values: dict[str, int] = {}
    active: set[str] = set()
    sliced = builtin_slices(dm)
    for obj in workloads:
        component = obj["metadata"].get("labels", {}).get(COMPONENT_LABEL)
        replicas = obj.get("spec", {}).get("replicas")
        if component not in ("render", "prefill", "decode") or replicas is None:
            continue
        if sliced and component != "render":
            slice_label = pod_template_of(obj).get("metadata", {}).get("labels", {})
            if int(replicas) > 0:
                active.add(str(slice_label.get(SLICE_LABEL, "0")))
            continue
        values[component] = values.get(component, 0) + int(replicas)
    return ReplicaPlan(
        render=values.get("render"), prefill=values.get("prefill"), decode=values.get("decode"),
        slices=len(active) if sliced and active else None,
    )  # fmt: skip


def built_plan(dm: DisaggregatedModel, plan: ReplicaPlan) -> ReplicaPlan:
    """What the builders will write for Builtin pools (the plan clamped into the bounds)."""
    render = None
    scaling = dm.spec.render.autoscaling
    if dm.spec.render.enabled and scaling.enabled and scaling.engine is RenderAutoscaler.builtin:
        render = render_replicas(dm, plan)
    engines: dict[str, int | None] = {"prefill": None, "decode": None}
    slices = None
    if builtin_slices(dm):
        slices = active_slices(dm, plan)
    else:
        for name, pool in dm.spec.engine_pools():
            auto = pool.autoscaling
            if auto is not None and auto.engine is EngineAutoscaler.builtin:
                chosen = getattr(plan, name)
                start = pool.replicas if chosen is None else chosen
                engines[name] = max(auto.min_replicas, min(auto.max_replicas, start))
    return ReplicaPlan(render, engines["prefill"], engines["decode"], slices)


def engine_current(dm: DisaggregatedModel, current: ReplicaPlan) -> dict[str, int | None]:
    """Engine replicas per pool of a built plan (sliced pools: replicas per slice x slices)."""
    if current.slices is not None:
        return {n: p.replicas * current.slices for n, p in dm.spec.engine_pools()}
    return {"prefill": current.prefill, "decode": current.decode}
