"""Where each slice's engine upgrade stands, read from its pods, and the partitions that keep
prefill and decode rolling in step (builders/rollout.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.api import DisaggregatedModel, EnginePoolSpec
from pdserve.builders.kv_compat import kv_compat_digest
from pdserve.builders.leaderworkerset import GROUP_INDEX_LABEL, NAME_LABEL, partition_of
from pdserve.builders.leaderworkerset import KIND as LWS_KIND
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


def replica_units(
    pool: EnginePoolSpec, name: str, pods: Sequence[Mapping[str, Any]]
) -> list[list[Mapping[str, Any]]]:
    """The replicas of the engine StatefulSet or LeaderWorkerSet `name` as lists of their
    running pods: a pod each, or a group's pods (by group index) when a replica spans nodes."""
    units: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        meta = pod["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        labels = meta.get("labels", {})
        if pool.multi_node:
            if labels.get(NAME_LABEL) == name:
                units.setdefault(str(labels.get(GROUP_INDEX_LABEL)), []).append(pod)
        elif owner_statefulset(pod) == name:
            units[meta["name"]] = [pod]
    return list(units.values())


def engine_rollout(
    dm: DisaggregatedModel,
    plan: ReplicaPlan | None,
    live_sets: Mapping[str, Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
) -> RolloutPlan:
    """The partitions of the engine StatefulSets and LeaderWorkerSets whose slice has a pod on
    another KV digest than the builders write; none when every engine pod runs it (or the model
    is aggregated: nothing is transferred). A LeaderWorkerSet's replicas are its groups: one is
    updated when all its pods run the new digest, updated and ready when all are also Ready."""
    if not dm.spec.disaggregated or dm.spec.prefill is None:
        return RolloutPlan()
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
                replicas = int(live_sets.get(name, {}).get("spec", {}).get("replicas", 0))
            units = replica_units(pool, name, pods)
            stale = stale or any(annotation(p) != digest for unit in units for p in unit)
            whole = [unit for unit in units if len(unit) >= pool.nodes_per_replica]
            updated = [unit for unit in whole if all(annotation(p) == digest for p in unit)]
            progress[component] = PoolProgress(
                replicas=replicas,
                updated=len(updated),
                updated_ready=sum(all(pod_ready(p) for p in unit) for unit in updated),
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
                unit = "group(s)" if pools[component].multi_node else "pod(s)"
                note += f"; {names[component]} holds {partition} {unit} on the old digest"
        notes.append(note)
    return RolloutPlan(partitions=held, notes=notes)


def annotation(pod: Mapping[str, Any]) -> str | None:
    value = pod["metadata"].get("annotations", {}).get(KV_COMPAT_ANNOTATION)
    return None if value is None else str(value)


def rollout_steps(rollout: RolloutPlan, live_sets: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What this pass changes in the held rollouts, one line per StatefulSet or
    LeaderWorkerSet (for Events)."""
    steps = []
    for name, live in sorted(live_sets.items()):
        before, after = partition_of(live), rollout.partition(name)
        if before == after:
            continue
        groups = live.get("kind") == LWS_KIND
        if after == 0:
            steps.append(f"{name} may roll every {'group' if groups else 'pod'} onto the new "
                         "engine revision")  # fmt: skip
        else:
            below = f"groups below index {after}" if groups else f"pods below ordinal {after}"
            steps.append(f"{name}: {below} stay on the old KV-compatibility digest until the "
                         "other pool catches up")  # fmt: skip
    return steps
