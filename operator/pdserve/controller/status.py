"""Status from the children's real state: pool replica counts, conditions, phase.

Pure functions: the reconciler feeds in what it read; nothing here talks to the API server."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pdserve.api import Condition, ConditionType, DisaggregatedModel, Phase
from pdserve.api.status import (
    DisaggregatedModelStatus,
    PoolsStatus,
    PoolStatus,
    SliceTransport,
)
from pdserve.builders import Component, endpoint
from pdserve.builders.leaderworkerset import KIND as LWS_KIND
from pdserve.contract.groups import whole_groups
from pdserve.contract.names import (
    COMPONENT_LABEL,
    LWS_GROUP_INDEX_LABEL,
    LWS_NAME_LABEL,
    SLICE_LABEL,
)
from pdserve.controller.health import HealthVerdict, kv_policy
from pdserve.controller.progress import (
    available,
    duration,
    load_progress,
    parse_time,
    past_deadline,
)
from pdserve.controller.replica_check import contract_condition
from pdserve.controller.rollout import pod_ready
from pdserve.controller.transport import verified_condition

# Container waiting reasons that will not fix themselves.
STUCK_REASONS = {
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError",
    "CreateContainerError", "InvalidImageName",
}  # fmt: skip


@dataclass
class Observation:
    """What the reconciler saw of one DisaggregatedModel's children."""

    workloads: dict[Component, list[Mapping[str, Any]]] = field(default_factory=dict)
    """StatefulSets/Deployments per pool (one per slice for engine pools)."""
    pods: Sequence[Mapping[str, Any]] = ()
    parity_drift: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # invalid spec: nothing was applied
    problem_reason: str = "InvalidSpec"  # or MissingAPI: the cluster lacks an API it needs
    warnings: list[str] = field(default_factory=list)  # e.g. a missing chat-template ConfigMap
    transport: list[SliceTransport] = field(default_factory=list)  # preflight verdicts
    health: HealthVerdict | None = None  # decode engines' NIXL metrics, last interval
    # Pods the gateways keep out of routing and why; None: spec.gateway.replicaCheck is Off.
    replica_mismatches: list[str] | None = None
    # Engine StatefulSets held so prefill and decode roll in step (controller/rollout.py).
    rollout_notes: list[str] = field(default_factory=list)
    # Why the namespace's Pod Security level refuses the model's pods; None: it admits them.
    pod_security: str | None = None


def observed_generation(workload: Mapping[str, Any]) -> int:
    """The generation the workload's controller last acted on. A LeaderWorkerSet (v0.7.0)
    records none (neither in status nor in its conditions): it counts as current while it
    says Available and no update is in progress."""
    status = workload.get("status", {})
    if workload.get("kind") != LWS_KIND:
        return int(status.get("observedGeneration", 0))
    said = {c.get("type"): c.get("status") for c in status.get("conditions", [])}
    settled = said.get("Available") == "True" and said.get("UpdateInProgress") != "True"
    return int(workload.get("metadata", {}).get("generation", 0)) if settled else 0


def ready_groups(workload: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> int:
    """Groups of a LeaderWorkerSet whose every pod is Ready, counted from the pods
    (pdserve.contract.groups): LWS v0.7.0 counts a group ready while a worker is still Pending
    (measured on the plane), and vLLM serves only once every rank of the group runs."""
    name = workload["metadata"]["name"]
    return sum(group[0] == name for group in whole_groups(pods, pod_ready))


def pool_status(
    workloads: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]] = ()
) -> tuple[PoolStatus, bool]:
    """(counts, rolled out) of a pool's StatefulSets/Deployments, summed over its slices; of a
    multi-node pool's LeaderWorkerSets, in groups (a group is ready when all its pods are)."""
    desired = ready = 0
    rolled_out = bool(workloads)
    for workload in workloads:
        spec, status = workload.get("spec", {}), workload.get("status", {})
        want = int(spec.get("replicas", 1))
        if workload.get("kind") == LWS_KIND:
            have = ready_groups(workload, pods)
        else:
            have = int(status.get("readyReplicas", 0))
        updated = int(status.get("updatedReplicas", 0))
        generation = workload.get("metadata", {}).get("generation", 0)
        rolled_out = (rolled_out and observed_generation(workload) >= generation
                      and updated >= want and have >= want)  # fmt: skip
        desired, ready = desired + want, ready + have
    groups = any(workload.get("kind") == LWS_KIND for workload in workloads)
    summary = f"{ready}/{desired} groups" if groups else f"{ready}/{desired}"
    return PoolStatus(desired=desired, ready=ready, summary=summary), rolled_out


def _unschedulable(pod: Mapping[str, Any]) -> str | None:
    for condition in pod.get("status", {}).get("conditions", []):
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return str(condition.get("message", ""))
    return None


def stranded_leaders(engines: Sequence[Mapping[str, Any]], topology_key: str | None) -> str:
    """What to do about groups whose leader is bound while a worker cannot be: a required
    podAffinity reserves nothing, so the leader may have taken a domain without room for the
    rest of its group, and the scheduler will not move it. Empty when there are none, or when
    groups have no domain to stay in (then the leader's node does not bind its workers)."""
    if topology_key is None:
        return ""
    bound = {p["metadata"]["name"]: p.get("spec", {}).get("nodeName") for p in engines}
    leaders: set[tuple[str, str]] = set()
    for pod in engines:
        labels = pod["metadata"].get("labels", {})
        if LWS_NAME_LABEL not in labels or _unschedulable(pod) is None:
            continue
        leader = f"{labels[LWS_NAME_LABEL]}-{labels.get(LWS_GROUP_INDEX_LABEL, '')}"
        if bound.get(leader):
            leaders.add((leader, str(bound[leader])))
    if not leaders:
        return ""
    named = ", ".join(f"{leader} on {node}" for leader, node in sorted(leaders))
    return (
        f". Group leaders bound where their workers do not fit: {named}. A group must fit in "
        f"one domain ({topology_key} of its leader's node): free room there, or delete the "
        "leader pod so the group is recreated and placed anew; a gang scheduler (Kueue, "
        "Volcano) places whole groups"
    )


def component_pods(
    pods: Sequence[Mapping[str, Any]], *components: Component
) -> list[Mapping[str, Any]]:
    wanted = {c.value for c in components}
    return [p for p in pods if p["metadata"].get("labels", {}).get(COMPONENT_LABEL) in wanted]


def engine_pods(pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return component_pods(pods, Component.prefill, Component.decode)


def placement_condition(
    dm: DisaggregatedModel, pods: Sequence[Mapping[str, Any]]
) -> tuple[bool | None, str, str]:
    """(status, reason, message) of Placement: where each slice's engines landed, or the
    scheduler's own words for the engine pods it cannot place."""
    engines = engine_pods(pods)
    refused = []
    for pod in engines:
        message = _unschedulable(pod)
        if message is not None:
            pool = pod["metadata"]["labels"][COMPONENT_LABEL]
            refused.append(f"{pool} pod {pod['metadata']['name']}: {message}")
    if refused:
        domain = dm.spec.placement.domain
        hint = (
            f" (placement.domain {domain.topology_key} is {domain.mode.value}: every pod of a "
            "slice must fit in one domain)"
            if domain is not None
            else ""
        )
        stranded = stranded_leaders(engines, dm.spec.placement.group_topology_key)
        return False, "Unschedulable", "; ".join(sorted(refused)) + hint + stranded
    nodes: dict[str, set[str]] = {}
    waiting = 0
    for pod in engines:
        node = pod.get("spec", {}).get("nodeName")
        if not node:
            waiting += 1
            continue
        nodes.setdefault(pod["metadata"].get("labels", {}).get(SLICE_LABEL, "0"), set()).add(node)
    if not engines:
        return None, "NoEnginePods", "no engine pods exist yet"
    if waiting:
        return None, "Scheduling", f"{waiting} of {len(engines)} engine pods wait for the scheduler"
    where = "; ".join(
        f"slice {index} on {', '.join(sorted(names))}" for index, names in sorted(nodes.items())
    )
    return True, "Placed", where


def stuck_pods(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """'decode pod qwen-decode-0: Unschedulable: 0/6 nodes are available: ...' per stuck pod."""
    found = []
    for pod in pods:
        name = pod["metadata"]["name"]
        pool = pod["metadata"].get("labels", {}).get(COMPONENT_LABEL, "?")
        status = pod.get("status", {})
        message = _unschedulable(pod)
        if message is not None:
            found.append(f"{pool} pod {name}: Unschedulable: {message}")
        for container in status.get("containerStatuses", []):
            waiting = container.get("state", {}).get("waiting", {})
            if waiting.get("reason") in STUCK_REASONS:
                found.append(
                    f"{pool} pod {name}: {waiting['reason']}: {waiting.get('message', '')}"
                )
    return found


def health_condition(
    dm: DisaggregatedModel, verdict: HealthVerdict | None
) -> tuple[bool | None, str, str]:
    if not dm.spec.disaggregated:
        return None, "NotDisaggregated", "no KV transfers: serving is aggregated"
    if verdict is None:
        return None, "NotMeasured", "no KV transfers measured yet"
    return verdict.healthy, verdict.reason, verdict.message


def condition(
    kind: ConditionType, ok: bool | None, reason: str, message: str, generation: int | None,
    previous: Mapping[str, Condition], now: str,
) -> Condition:  # fmt: skip
    """ok None: Unknown."""
    status: Literal["True", "False", "Unknown"] = (
        "Unknown" if ok is None else "True" if ok else "False"
    )
    before = previous.get(kind.value)
    # lastTransitionTime moves only when the status flips.
    since = before.last_transition_time if before is not None and before.status == status else now
    return Condition(
        type=kind.value, status=status, reason=reason, message=message,
        last_transition_time=since, observed_generation=generation,
    )  # fmt: skip


def compute_status(
    dm: DisaggregatedModel | None,
    seen: Observation,
    previous: DisaggregatedModelStatus | None,
    *,
    generation: int | None,
    parity: str | None,
    now: str,
) -> DisaggregatedModelStatus:
    before = {c.type: c for c in (previous.conditions if previous else [])}
    if dm is None or seen.problems:
        message = "; ".join(seen.problems) or "the spec is invalid"
        invalid = [
            condition(kind, kind is ConditionType.degraded, seen.problem_reason, message,
                      generation, before, now)
            for kind in (ConditionType.ready, ConditionType.progressing, ConditionType.degraded)
        ]  # fmt: skip
        return DisaggregatedModelStatus(
            observed_generation=generation,
            phase=Phase.failed,
            conditions=invalid,
            pools=previous.pools if previous else PoolsStatus(),
            parity_hash=previous.parity_hash if previous else None,
            endpoint=previous.endpoint if previous else None,
        )

    wanted: list[Component] = []
    if dm.spec.disaggregated:
        wanted.append(Component.prefill)
    wanted.append(Component.decode)
    if dm.spec.render.enabled:
        wanted.append(Component.render)
    wanted.append(Component.gateway)
    pools: dict[str, PoolStatus] = {}
    waiting: list[str] = []
    for component in wanted:
        counts, rolled_out = pool_status(seen.workloads.get(component, []), seen.pods)
        pools[component.value] = counts
        if not rolled_out:
            waiting.append(f"{component.value} {counts.ready}/{counts.desired} ready")

    stuck = stuck_pods(seen.pods)
    ready = not waiting
    mismatched = seen.replica_mismatches or []
    moment = parse_time(now)
    progress = load_progress(seen.pods, moment) if moment is not None and not ready else []
    late = (past_deadline(seen.pods, moment, dm.spec.progress_deadline_seconds)
            if moment is not None and not ready else [])  # fmt: skip
    deadline = (
        [f"not Ready {duration(dm.spec.progress_deadline_seconds)} after creation "
         "(spec.progressDeadlineSeconds): " + "; ".join(late)] if late else []
    )  # fmt: skip
    degraded_reasons = stuck + deadline + seen.warnings + mismatched
    serving, serving_reason, serving_message = available(dm, pools)
    conditions = [
        condition(
            ConditionType.ready, ready,
            "AllPoolsReady" if ready else "PoolsNotReady",
            "every pool is ready" if ready else "waiting for " + ", ".join(waiting),
            generation, before, now,
        ),
        condition(
            ConditionType.available, serving, serving_reason, serving_message,
            generation, before, now,
        ),
        condition(
            ConditionType.progressing, not ready and not late,
            "ProgressDeadlineExceeded" if late else "RollingOut" if not ready
            else "RolloutComplete",
            "; ".join([", ".join(waiting), *seen.rollout_notes, *(late or progress)]) if waiting
            else f"all pools serve generation {generation}",
            generation, before, now,
        ),
        condition(
            ConditionType.config_parity, not seen.parity_drift,
            "InParity" if not seen.parity_drift else "DriftRepaired",
            "render, prefill and decode share parity hash " + str(parity)
            if not seen.parity_drift else "; ".join(seen.parity_drift),
            generation, before, now,
        ),
        condition(
            ConditionType.degraded, bool(degraded_reasons),
            "PodsStuck" if stuck else "ProgressDeadlineExceeded" if deadline
            else "ConfigMissing" if seen.warnings
            else "ReplicaMismatch" if mismatched else "AsExpected",
            "; ".join(degraded_reasons) if degraded_reasons else "no stuck pods",
            generation, before, now,
        ),
    ]  # fmt: skip
    placed, reason, message = (
        (False, "PodSecurity", seen.pod_security)
        if seen.pod_security is not None
        else placement_condition(dm, seen.pods)
    )
    conditions.append(
        condition(ConditionType.placement, placed, reason, message, generation, before, now)
    )
    verified, reason, message = verified_condition(seen.transport)
    conditions.append(
        condition(
            ConditionType.transport_verified, verified, reason, message, generation, before, now
        )
    )
    conditions.append(
        condition(ConditionType.transport_healthy, *health_condition(dm, seen.health), generation,
                  before, now)
    )  # fmt: skip
    conditions.append(
        condition(ConditionType.kv_policy, *kv_policy(dm, seen.health), generation, before, now)
    )
    conditions.append(
        condition(ConditionType.contract_verified, *contract_condition(seen.replica_mismatches),
                  generation, before, now)
    )  # fmt: skip
    if degraded_reasons:
        phase = Phase.degraded
    elif ready:
        phase = Phase.ready
    else:
        phase = Phase.progressing
    return DisaggregatedModelStatus(
        observed_generation=generation,
        phase=phase,
        conditions=conditions,
        pools=PoolsStatus(
            prefill=pools.get("prefill"),
            decode=pools["decode"],
            render=pools.get("render"),
            gateway=pools["gateway"],
        ),
        parity_hash=parity,
        endpoint=endpoint(dm),
        transport=seen.transport,
    )
