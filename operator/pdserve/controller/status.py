"""Status from the children's real state: pool replica counts, conditions, phase.

Pure functions: the reconciler feeds in what it read; nothing here talks to the API server."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pdserve.api import Condition, ConditionType, DisaggregatedModel, Phase
from pdserve.api.status import DisaggregatedModelStatus, PoolsStatus, PoolStatus
from pdserve.builders import Component, endpoint
from pdserve.builders.names import COMPONENT_LABEL

# Container waiting reasons that will not fix themselves.
STUCK_REASONS = {
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError",
    "CreateContainerError", "InvalidImageName",
}  # fmt: skip


@dataclass
class Observation:
    """What the reconciler saw of one DisaggregatedModel's children."""

    workloads: dict[Component, Mapping[str, Any]] = field(default_factory=dict)
    pods: Sequence[Mapping[str, Any]] = ()
    parity_drift: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # invalid spec: nothing was applied
    warnings: list[str] = field(default_factory=list)  # e.g. a missing chat-template ConfigMap


def pool_status(workload: Mapping[str, Any] | None) -> tuple[PoolStatus, bool]:
    """(counts, rolled out) of one StatefulSet/Deployment."""
    if workload is None:
        return PoolStatus(desired=0, ready=0, summary="0/0"), False
    spec, status = workload.get("spec", {}), workload.get("status", {})
    desired = int(spec.get("replicas", 1))
    ready = int(status.get("readyReplicas", 0))
    updated = int(status.get("updatedReplicas", 0))
    generation = workload.get("metadata", {}).get("generation", 0)
    observed = status.get("observedGeneration", 0)
    rolled_out = observed >= generation and updated >= desired and ready >= desired
    return PoolStatus(desired=desired, ready=ready, summary=f"{ready}/{desired}"), rolled_out


def stuck_pods(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """'decode pod qwen-decode-0: Unschedulable: 0/6 nodes are available: ...' per stuck pod."""
    found = []
    for pod in pods:
        name = pod["metadata"]["name"]
        pool = pod["metadata"].get("labels", {}).get(COMPONENT_LABEL, "?")
        status = pod.get("status", {})
        for condition in status.get("conditions", []):
            if (
                condition.get("type") == "PodScheduled"
                and condition.get("reason") == "Unschedulable"
            ):
                found.append(f"{pool} pod {name}: Unschedulable: {condition.get('message', '')}")
        for container in status.get("containerStatuses", []):
            waiting = container.get("state", {}).get("waiting", {})
            if waiting.get("reason") in STUCK_REASONS:
                found.append(
                    f"{pool} pod {name}: {waiting['reason']}: {waiting.get('message', '')}"
                )
    return found


def condition(
    kind: ConditionType, ok: bool, reason: str, message: str, generation: int | None,
    previous: Mapping[str, Condition], now: str,
) -> Condition:  # fmt: skip
    status: Literal["True", "False"] = "True" if ok else "False"
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
            condition(kind, kind is ConditionType.degraded, "InvalidSpec", message, generation,
                      before, now)
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
        counts, rolled_out = pool_status(seen.workloads.get(component))
        pools[component.value] = counts
        if not rolled_out:
            waiting.append(f"{component.value} {counts.ready}/{counts.desired} ready")

    stuck = stuck_pods(seen.pods)
    ready = not waiting
    degraded_reasons = stuck + seen.warnings
    conditions = [
        condition(
            ConditionType.ready, ready,
            "AllPoolsReady" if ready else "PoolsNotReady",
            "every pool is ready" if ready else "waiting for " + ", ".join(waiting),
            generation, before, now,
        ),
        condition(
            ConditionType.progressing, not ready,
            "RollingOut" if not ready else "RolloutComplete",
            ", ".join(waiting) if waiting else f"all pools serve generation {generation}",
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
            "PodsStuck" if stuck else ("ConfigMissing" if seen.warnings else "AsExpected"),
            "; ".join(degraded_reasons) if degraded_reasons else "no stuck pods",
            generation, before, now,
        ),
    ]  # fmt: skip
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
    )
