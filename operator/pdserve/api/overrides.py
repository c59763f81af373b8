"""Pod fields a cluster's own rules need and pdserve does not derive (priority, scheduler,
runtime class, identity, labels, volumes, init containers and sidecars, spread, affinity,
securityContext), merged onto the pods pdserve builds. What carries parity or wiring (the
vLLM command and arguments, the parity environment, ports, the KV side channel, pdserve's own
volumes, labels and containers) is not here, and a name or path that would collide with
pdserve's is refused, naming the field."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, JsonValue, field_validator

from pdserve.api.base import ApiModel
from pdserve.api.common import LabelMap, PreservedObject
from pdserve.contract.pod_layout import CONTAINERS, LABEL_PREFIXES, MOUNT_PATHS, VOLUMES

OperatorName = Annotated[str, Field(min_length=1, max_length=253)]


def _names(objects: list[dict[str, JsonValue]], what: str) -> list[str]:
    names = []
    for index, each in enumerate(objects):
        name = each.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"[{index}] has no name: every {what} needs one")
        names.append(name)
    if len(set(names)) != len(names):
        raise ValueError(f"two {what}s share a name ({', '.join(sorted(names))})")
    return names


class PodOverrides(ApiModel):
    """Merged onto the pool's pods as pdserve builds them: scalars set, lists appended, the
    securityContexts replaced (the gateway's and render's default is Pod Security restricted,
    the engines' none)."""

    labels: LabelMap = Field(default_factory=dict)
    """Labels added to the pods (keys under app.kubernetes.io/ and pdserve.io/ are pdserve's)."""
    priority_class_name: OperatorName | None = None
    """The pods' PriorityClass."""
    scheduler_name: OperatorName | None = None
    """The scheduler that places the pods (Kueue, KAI Scheduler, Volcano); default-scheduler
    when unset."""
    runtime_class_name: OperatorName | None = None
    """The pods' RuntimeClass (e.g. nvidia, where the NVIDIA runtime is not the default)."""
    service_account_name: OperatorName | None = None
    """The pods' ServiceAccount (workload identity for a model store). Not for the gateway,
    whose ServiceAccount pdserve creates with the rights discovery needs."""
    security_context: PreservedObject | None = None
    """The pod's securityContext, in place of pdserve's."""
    container_security_context: PreservedObject | None = None
    """The main container's securityContext (vllm, render or gateway), in place of pdserve's."""
    volumes: list[PreservedObject] = Field(default_factory=list)
    """Volumes added to the pods."""
    volume_mounts: list[PreservedObject] = Field(default_factory=list)
    """Mounts added to the main container."""
    init_containers: list[PreservedObject] = Field(default_factory=list)
    """Init containers, run before the main container."""
    sidecars: list[PreservedObject] = Field(default_factory=list)
    """Containers added beside the main container."""
    topology_spread_constraints: list[PreservedObject] = Field(default_factory=list)
    """The pods' topologySpreadConstraints."""
    affinity: PreservedObject | None = None
    """Pod affinity and anti-affinity terms and preferred node affinity, added to pdserve's
    (spec.placement's for engines). Required node affinity is refused: use the pool's
    nodeSelector, which is ANDed with pdserve's own terms."""

    @field_validator("labels")
    @classmethod
    def _own_labels(cls, labels: LabelMap) -> LabelMap:
        taken = sorted(k for k in labels if k.startswith(LABEL_PREFIXES))
        if taken:
            raise ValueError(
                f"{', '.join(taken)}: keys under {' and '.join(LABEL_PREFIXES)} are "
                "pdserve's (selectors, model, slice); use a key of your own"
            )
        return labels

    @field_validator("volumes")
    @classmethod
    def _own_volumes(cls, volumes: list[dict[str, JsonValue]]) -> list[dict[str, JsonValue]]:
        taken = sorted(set(_names(volumes, "volume")) & VOLUMES)
        if taken:
            raise ValueError(
                f"volume name {', '.join(taken)} is pdserve's own "
                f"({', '.join(sorted(VOLUMES))}); rename yours"
            )
        return volumes

    @field_validator("volume_mounts")
    @classmethod
    def _own_paths(cls, mounts: list[dict[str, JsonValue]]) -> list[dict[str, JsonValue]]:
        for index, mount in enumerate(mounts):
            path = mount.get("mountPath")
            if not isinstance(path, str) or not path.startswith("/"):
                raise ValueError(f"[{index}].mountPath must be an absolute path")
            clash = [r for r in MOUNT_PATHS if _within(path, r) or _within(r, path)]
            if clash:
                raise ValueError(
                    f"[{index}].mountPath {path} overlaps pdserve's mount {clash[0]}; "
                    "mount elsewhere"
                )
            if mount.get("name") in VOLUMES:
                raise ValueError(
                    f"[{index}].name {mount['name']} is pdserve's own volume; mount a volume "
                    "of podOverrides.volumes"
                )
        return mounts

    @field_validator("init_containers", "sidecars")
    @classmethod
    def _own_containers(cls, containers: list[dict[str, JsonValue]]) -> list[dict[str, JsonValue]]:
        taken = sorted(set(_names(containers, "container")) & CONTAINERS)
        if taken:
            raise ValueError(f"container name {', '.join(taken)} is pdserve's own; rename yours")
        return containers

    @field_validator("affinity")
    @classmethod
    def _added_terms_only(cls, affinity: dict[str, Any] | None) -> dict[str, Any] | None:
        if affinity is None:
            return None
        unknown = sorted(set(affinity) - {"nodeAffinity", "podAffinity", "podAntiAffinity"})
        if unknown:
            raise ValueError(f"unknown member {', '.join(unknown)}")
        node = affinity.get("nodeAffinity") or {}
        if "requiredDuringSchedulingIgnoredDuringExecution" in node:
            raise ValueError(
                "nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution would be ORed "
                "with pdserve's own node terms; use the pool's nodeSelector (or "
                "spec.placement.nodeSelector for engines)"
            )
        return affinity


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")
