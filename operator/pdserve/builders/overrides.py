"""A pool's podOverrides merged onto the pod template pdserve built: scalars set, lists appended,
securityContexts replaced, affinity terms added. What may not be overridden was refused when the
spec was parsed (api/overrides.py), so the merge never takes a name or path pdserve uses."""

from __future__ import annotations

import copy
from typing import Any

from pdserve.api.overrides import PodOverrides

SCALARS = {
    "priority_class_name": "priorityClassName",
    "scheduler_name": "schedulerName",
    "runtime_class_name": "runtimeClassName",
    "service_account_name": "serviceAccountName",
}
LISTS = {
    "volumes": "volumes",
    "init_containers": "initContainers",
    "topology_spread_constraints": "topologySpreadConstraints",
}
AFFINITY_LISTS = {
    "podAffinity": ("requiredDuringSchedulingIgnoredDuringExecution",
                    "preferredDuringSchedulingIgnoredDuringExecution"),
    "podAntiAffinity": ("requiredDuringSchedulingIgnoredDuringExecution",
                        "preferredDuringSchedulingIgnoredDuringExecution"),
    "nodeAffinity": ("preferredDuringSchedulingIgnoredDuringExecution",),
}  # fmt: skip


def with_overrides(template: dict[str, Any], overrides: PodOverrides) -> dict[str, Any]:
    """`template` (a pod template: metadata and spec, its first container the main one) with
    `overrides` merged; the input is left as it was."""
    if overrides == PodOverrides():
        return template
    merged = copy.deepcopy(template)
    metadata, spec = merged["metadata"], merged["spec"]
    metadata["labels"] = {**overrides.labels, **metadata.get("labels", {})}
    for field, key in SCALARS.items():
        value = getattr(overrides, field)
        if value is not None:
            spec[key] = value
    if overrides.service_account_name is not None:
        # A ServiceAccount of the user's: its token is theirs to mount (workload identity).
        spec.pop("automountServiceAccountToken", None)
    for field, key in LISTS.items():
        added = getattr(overrides, field)
        if added:
            spec[key] = [*spec.get(key, []), *added]
    main = spec["containers"][0]
    if overrides.volume_mounts:
        main["volumeMounts"] = [*main.get("volumeMounts", []), *overrides.volume_mounts]
    if overrides.container_security_context is not None:
        main["securityContext"] = overrides.container_security_context
    if overrides.security_context is not None:
        spec["securityContext"] = overrides.security_context
    if overrides.sidecars:
        spec["containers"] = [*spec["containers"], *overrides.sidecars]
    if overrides.affinity:
        spec["affinity"] = added_affinity(spec.get("affinity") or {}, overrides.affinity)
    return merged


def added_affinity(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """pdserve's affinity with the override's terms added: required pod (anti-)affinity terms
    all hold (ANDed), preferred terms add their weights; pdserve's required node terms stay
    as they are (a required node term added would be ORed with them, so it is refused)."""
    merged = copy.deepcopy(ours)
    for kind, lists in AFFINITY_LISTS.items():
        for key in lists:
            added = (theirs.get(kind) or {}).get(key) or []
            if added:
                section = merged.setdefault(kind, {})
                section[key] = [*section.get(key, []), *added]
    return merged
