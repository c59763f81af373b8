"""Where each slice's engine upgrade stands, read from its pods, and the partitions that keep
prefill and decode rolling in step (builders/rollout.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.builders.kv_compat import kv_compat_digest
from pdserve.builders.names import engine_name
from pdserve.builders.rollout import PoolProgress, RolloutPlan, partitions
from pdserve.builders.scaling import ReplicaPlan, engine_replicas
from pdserve.contract.names import KV_COMPAT_ANNOTATION, Component


def pod_ready(pod: Mapping[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def owner_statefulset(pod: Mapping[str, Any]) -> str | None:
    for owner in pod["metadata"].get("ownerReferences", []):
        if owner.get("kind") == "StatefulSet":
            return str(owner.get("name"))
    return None


def engine_rollout(
    dm: DisaggregatedModel,
    plan: ReplicaPlan | None,
    live_statefulsets: Mapping[str, Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
) -> RolloutPlan:
    """The partitions of the engine StatefulSets whose slice has a pod on another KV digest
    than the builders write; none when every engine pod runs it (or the model is aggregated:
    nothing is transferred)."""
    if not dm.spec.disaggregated or dm.spec.prefill is None:
        return RolloutPlan()
    by_owner: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        owner = owner_statefulset(pod)
        if owner is not None and not pod["metadata"].get("deletionTimestamp"):
            by_owner.setdefault(owner, []).append(pod)
    pools = {Component.prefill: dm.spec.prefill, Component.decode: dm.spec.decode}
    held: dict[str, int] = {}
    notes: list[str] = []
    for slice_index in range(dm.spec.placement.slices):
        progress: dict[Component, PoolProgress] = {}
        names: dict[Component, str] = {}
        stale = False
        for component, pool in pools.items():
            name = names[component] = engine_name(dm, component, slice_index)
            digest = kv_compat_digest(dm, pool)
            replicas = engine_replicas(dm, component, pool, slice_index, plan)
            if replicas is None:  # an External autoscaler owns them
                replicas = int(live_statefulsets.get(name, {}).get("spec", {}).get("replicas", 0))
            running = by_owner.get(name, [])
            updated = [p for p in running if annotation(p) == digest]
            stale = stale or len(updated) < len(running)
            progress[component] = PoolProgress(
                replicas=replicas,
                updated=len(updated),
                updated_ready=sum(pod_ready(p) for p in updated),
            )
        if not stale:
            continue
        prefill, decode = progress[Component.prefill], progress[Component.decode]
        prefill_partition, decode_partition = partitions(prefill, decode)
        chosen = {Component.prefill: prefill_partition, Component.decode: decode_partition}
        note = (
            f"engines rolling in step onto a new KV-compatibility digest: prefill "
            f"{prefill.updated_ready}/{prefill.replicas} and decode "
            f"{decode.updated_ready}/{decode.replicas} ready on it"
        )
        for component, partition in chosen.items():
            if partition > 0:
                held[names[component]] = partition
                note += f"; {names[component]} holds {partition} pod(s) on the old digest"
        notes.append(note)
    return RolloutPlan(partitions=held, notes=notes)


def annotation(pod: Mapping[str, Any]) -> str | None:
    value = pod["metadata"].get("annotations", {}).get(KV_COMPAT_ANNOTATION)
    return None if value is None else str(value)


def live_partition(statefulset: Mapping[str, Any]) -> int:
    strategy = statefulset.get("spec", {}).get("updateStrategy", {})
    return int(strategy.get("rollingUpdate", {}).get("partition", 0))


def rollout_steps(
    rollout: RolloutPlan, live_statefulsets: Mapping[str, Mapping[str, Any]]
) -> list[str]:
    """What this pass changes in the held rollouts, one line per StatefulSet (for Events)."""
    steps = []
    for name, live in sorted(live_statefulsets.items()):
        before, after = live_partition(live), rollout.partition(name)
        if before == after:
            continue
        if after == 0:
            steps.append(f"{name} may roll every pod onto the new engine revision")
        else:
            steps.append(f"{name}: pods below ordinal {after} stay on the old "
                         f"KV-compatibility digest until the other pool catches up")  # fmt: skip
    return steps
