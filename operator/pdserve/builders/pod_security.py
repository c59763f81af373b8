"""Pod Security Standards, judged on the pod templates pdserve builds, before any pod exists.

A namespace that enforces a Pod Security level (label pod-security.kubernetes.io/enforce) makes
the API server refuse every pod that breaks it; a StatefulSet then reports FailedCreate and its
pods never appear. The checks below are those of Kubernetes' pod-security-admission ("latest"
policy), named as the API server names them in its refusals; tests/cluster holds them to the
real API server's verdicts on the same templates."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pdserve.builders.leaderworkerset import pod_template_of
from pdserve.contract.names import COMPONENT_LABEL, Component

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"


class PodSecurityLevel(StrEnum):
    privileged = "privileged"
    baseline = "baseline"
    restricted = "restricted"


# Capabilities baseline lets a container add (pod-security-admission's capabilities_baseline).
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})  # fmt: skip
# Volume sources restricted allows (restrictedVolumes).
RESTRICTED_VOLUMES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image",
    "persistentVolumeClaim", "projected", "secret",
})  # fmt: skip
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet", "Job")
# Baseline checks a restricted check replaces (pod-security-admission's OverrideCheckIDs:
# capabilities_restricted over capabilities_baseline, restrictedVolumes over hostPathVolumes,
# seccompProfile_restricted over seccompProfile_baseline): at restricted the API server names
# only the stricter check, e.g. IPC_LOCK as "unrestricted capabilities", never as
# "non-default capabilities".
OVERRIDDEN_AT_RESTRICTED = frozenset({"non-default capabilities", "hostPath volumes",
                                      "seccompProfile"})  # fmt: skip


def enforced_level(namespace_labels: Mapping[str, str]) -> PodSecurityLevel:
    """The level the namespace enforces; no label: privileged (the API server's default, unless
    its admission configuration sets another). An unknown value: restricted, the strictest."""
    value = namespace_labels.get(ENFORCE_LABEL)
    if value is None:
        return PodSecurityLevel.privileged
    try:
        return PodSecurityLevel(value)
    except ValueError:
        return PodSecurityLevel.restricted


@dataclass(frozen=True)
class Violation:
    check: str  # the API server's name for it, e.g. "non-default capabilities"
    detail: str


def _containers(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _baseline(spec: Mapping[str, Any]) -> Iterable[Violation]:
    hosts = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    if hosts:
        yield Violation("host namespaces", ", ".join(hosts))
    for container in _containers(spec):
        name = container.get("name", "")
        security = container.get("securityContext") or {}
        if security.get("privileged"):
            yield Violation("privileged", f'container "{name}" must not set privileged=true')
        added = sorted(set(security.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES)
        if added:
            yield Violation(
                "non-default capabilities",
                f'container "{name}" must not include {", ".join(added)} in '
                "securityContext.capabilities.add",
            )
        # The API server gives a host-network pod's ports hostPort = containerPort.
        ports = [
            p.get("hostPort") or (p.get("containerPort") if spec.get("hostNetwork") else None)
            for p in container.get("ports", [])
        ]
        if used := [str(p) for p in ports if p]:
            yield Violation("hostPort", f'container "{name}" uses hostPorts {", ".join(used)}')
    if paths := [v["name"] for v in spec.get("volumes", []) if "hostPath" in v]:
        yield Violation("hostPath volumes", ", ".join(paths))
    for holder in (spec, *_containers(spec)):
        profile = (holder.get("securityContext") or {}).get("seccompProfile") or {}
        if profile.get("type") == "Unconfined":
            yield Violation("seccompProfile", "seccompProfile.type must not be Unconfined")


def _restricted(spec: Mapping[str, Any]) -> Iterable[Violation]:
    pod = spec.get("securityContext") or {}
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if kinds and not kinds <= RESTRICTED_VOLUMES:
            yield Violation("restricted volume types", f'volume "{volume["name"]}"')
    for container in _containers(spec):
        name = container.get("name", "")
        security = container.get("securityContext") or {}
        if security.get("allowPrivilegeEscalation") is not False:
            yield Violation(
                "allowPrivilegeEscalation != false",
                f'container "{name}" must set securityContext.allowPrivilegeEscalation=false',
            )
        capabilities = security.get("capabilities") or {}
        problems = []
        if "ALL" not in capabilities.get("drop", []):
            problems.append('must set securityContext.capabilities.drop=["ALL"]')
        if added := sorted(set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}):
            problems.append(
                f"must not include {', '.join(added)} in securityContext.capabilities.add"
            )
        if problems:
            yield Violation(
                "unrestricted capabilities", f'container "{name}" {"; ".join(problems)}'
            )
        if not security.get("runAsNonRoot", pod.get("runAsNonRoot")):
            yield Violation(
                "runAsNonRoot != true",
                f'container "{name}" must set securityContext.runAsNonRoot=true',
            )
        if security.get("runAsUser", pod.get("runAsUser")) == 0:
            yield Violation("runAsUser=0", f'container "{name}" must not set runAsUser=0')
        profile = security.get("seccompProfile") or pod.get("seccompProfile") or {}
        if profile.get("type") not in ("RuntimeDefault", "Localhost"):
            yield Violation(
                "seccompProfile",
                f'container "{name}" must set securityContext.seccompProfile.type to '
                '"RuntimeDefault" or "Localhost"',
            )


def pod_violations(spec: Mapping[str, Any], level: PodSecurityLevel) -> list[Violation]:
    """What in one pod spec the level forbids (none at privileged)."""
    if level is PodSecurityLevel.privileged:
        return []
    found = list(_baseline(spec))
    if level is PodSecurityLevel.restricted:
        found = [v for v in found if v.check not in OVERRIDDEN_AT_RESTRICTED]
        found += _restricted(spec)
    return found


@dataclass(frozen=True)
class TemplateViolations:
    """One workload whose pods the namespace's level would refuse."""

    component: str
    workload: str
    violations: tuple[Violation, ...]
    baseline_checks: tuple[str, ...] = ()
    """What baseline alone refuses: the checks only the privileged level lets through."""

    @property
    def checks(self) -> list[str]:
        return sorted({v.check for v in self.violations})


def refused_templates(
    objects: Sequence[Mapping[str, Any]], level: PodSecurityLevel
) -> list[TemplateViolations]:
    """The built workloads whose pod template `level` refuses."""
    refused = []
    for obj in objects:
        if obj.get("kind") not in WORKLOAD_KINDS:
            continue
        template = pod_template_of(obj)
        found = pod_violations(template["spec"], level)
        if found:
            component = template["metadata"].get("labels", {}).get(COMPONENT_LABEL, "")
            baseline = pod_violations(template["spec"], PodSecurityLevel.baseline)
            refused.append(
                TemplateViolations(
                    component,
                    obj["metadata"]["name"],
                    tuple(found),
                    tuple(sorted({v.check for v in baseline})),
                )
            )
    return refused


# What in the spec made a check fail, and how to do without it.
_CAUSES = {
    "host namespaces": "spec.placement.rdma.hostNetwork (the host network)",
    "hostPort": "spec.placement.rdma.hostNetwork (host ports)",
    "non-default capabilities": "spec.placement.rdma (capability IPC_LOCK, which RDMA needs to "
    "register memory with the NIC)",
    "hostPath volumes": "spec.model.source.hf.cache.hostPath (a hostPath volume)",
}
_WITHOUT = {
    "host namespaces": "remove placement.rdma (NIXL then moves KV over TCP)",
    "hostPort": "remove placement.rdma (NIXL then moves KV over TCP)",
    "non-default capabilities": "remove placement.rdma (NIXL then moves KV over TCP)",
    "hostPath volumes": "use a claimName for the model cache",
}


def pod_security_problem(
    namespace: str, level: PodSecurityLevel, refused: Sequence[TemplateViolations]
) -> str | None:
    """One message naming the namespace's level, what each pool breaks, the spec fields that
    cause it and the fix; None when nothing is refused."""
    if not refused:
        return None
    pools: dict[str, set[str]] = {}
    for template in refused:
        pools.setdefault(template.component, set()).update(template.checks)
    order = [c.value for c in Component]
    broken = "; ".join(
        f"{pool}: {', '.join(sorted(pools[pool]))}"
        for pool in sorted(pools, key=lambda p: order.index(p) if p in order else len(order))
    )
    checks = set().union(*pools.values())
    # At restricted, IPC_LOCK is reported as "unrestricted capabilities"; what needs privileged
    # is what baseline alone refuses.
    needs_privileged = {c for t in refused for c in t.baseline_checks}
    causes = sorted({_CAUSES[c] for c in checks | needs_privileged if c in _CAUSES})
    own = sorted(checks - set(_CAUSES))
    reasons = [f"caused by {', '.join(causes)}"] if causes else []
    if own:
        reasons.append(
            f"{', '.join(own)}: the engines run vLLM's images as root (the gateway and "
            "render pods pass restricted)"
        )
    least = PodSecurityLevel.privileged if causes else PodSecurityLevel.baseline
    fix = f"label namespace {namespace} {ENFORCE_LABEL}={least.value} (or exempt it)"
    alternatives = sorted({_WITHOUT[c] for c in checks | needs_privileged if c in _WITHOUT})
    if alternatives:
        fix += ", or " + ", or ".join(alternatives)
    return (
        f"namespace {namespace} enforces Pod Security {level.value!r} ({ENFORCE_LABEL}), which "
        f"refuses these pods ({broken}): {'; '.join(reasons)}. Fix: {fix}"
    )
