"""Multi-node replicas as pods see them: the LeaderWorkerSet group a pod belongs to, and which
groups have every pod Ready. One rule for the operator (a pool's ready groups) and the gateway
(a group's pods are routable only together): vLLM's ranks of a group step together, so one
missing rank stalls all of them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pdserve.contract.names import LWS_GROUP_INDEX_LABEL, LWS_NAME_LABEL, LWS_SIZE_ANNOTATION

Group = tuple[str, str]  # (LeaderWorkerSet name, group index)


def group_of(pod: Mapping[str, Any]) -> Group | None:
    """The pod's group; None for a pod of no LeaderWorkerSet."""
    labels = pod["metadata"].get("labels", {})
    if LWS_NAME_LABEL not in labels:
        return None
    return str(labels[LWS_NAME_LABEL]), str(labels.get(LWS_GROUP_INDEX_LABEL, ""))


def whole_groups(
    pods: Iterable[Mapping[str, Any]], ready: Callable[[Mapping[str, Any]], bool]
) -> set[Group]:
    """The groups with as many `ready` pods as their size (LWS's size annotation on each pod)."""
    counts: dict[Group, int] = {}
    sizes: dict[Group, int] = {}
    for pod in pods:
        group = group_of(pod)
        if group is None or not ready(pod):
            continue
        counts[group] = counts.get(group, 0) + 1
        size = pod["metadata"].get("annotations", {}).get(LWS_SIZE_ANNOTATION, "")
        sizes[group] = int(size) if size.isdigit() else 1
    return {group for group, count in counts.items() if count >= sizes[group]}
