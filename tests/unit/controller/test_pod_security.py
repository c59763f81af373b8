"""A namespace's Pod Security level, judged on the pods pdserve would create: RDMA engines need
what baseline forbids, and nothing pdserve makes meets restricted yet; each refusal names the
level, the pools, the spec fields that cause it and the fix."""

from __future__ import annotations

from typing import Any

from pdserve.api import parse_resource
from pdserve.builders.pod_security import (
    PodSecurityLevel,
    enforced_level,
    pod_violations,
)
from pdserve.controller.pod_security import judged
from pdserve.controller.status import Observation, compute_status
from tests.unit.api.test_api import resource

RDMA = {"resource": "rdma/rdma_shared_device_a"}
GUARANTEED = {"requests": {"cpu": "8", "memory": "64Gi"}}


def model(**spec: Any) -> Any:
    return parse_resource(resource(**{"prefill": {}, **spec}))


def rdma_model(**rdma: Any) -> Any:
    return model(
        placement={"rdma": {**RDMA, **rdma}},
        prefill={"resources": GUARANTEED},
        decode={"resources": GUARANTEED},
    )


def test_no_label_means_privileged_and_an_unknown_level_the_strictest() -> None:
    assert enforced_level({}) is PodSecurityLevel.privileged
    assert enforced_level({"pod-security.kubernetes.io/enforce": "baseline"}).value == "baseline"
    assert enforced_level({"pod-security.kubernetes.io/enforce": "tight"}).value == "restricted"


def test_plain_engines_pass_baseline_and_everything_passes_privileged() -> None:
    assert judged(model(), PodSecurityLevel.baseline) is None
    assert judged(rdma_model(hostNetwork=True), PodSecurityLevel.privileged) is None


def test_rdma_engines_are_refused_at_baseline_naming_placement_rdma_and_the_fix() -> None:
    message = judged(rdma_model(), PodSecurityLevel.baseline)
    assert message is not None
    assert message.startswith("namespace llm enforces Pod Security 'baseline'")
    assert "prefill: non-default capabilities; decode: non-default capabilities" in message
    assert "spec.placement.rdma (capability IPC_LOCK" in message
    assert "pod-security.kubernetes.io/enforce=privileged" in message
    assert "or remove placement.rdma" in message
    assert "render" not in message
    assert "gateway" not in message


def test_host_network_adds_host_namespaces_and_the_ports_the_server_gives_it() -> None:
    message = judged(rdma_model(hostNetwork=True), PodSecurityLevel.baseline)
    assert message is not None
    assert "host namespaces, hostPort, non-default capabilities" in message
    assert "spec.placement.rdma.hostNetwork (host ports)" in message


def test_restricted_refuses_the_engines_only_and_says_baseline_is_enough_without_rdma() -> None:
    message = judged(model(), PodSecurityLevel.restricted)
    assert message is not None
    for pool in ("prefill", "decode"):
        assert f"{pool}: allowPrivilegeEscalation != false" in message
    # The CPU pods run as a non-root user with the restricted securityContext.
    assert "render:" not in message
    assert "gateway:" not in message
    assert "runAsNonRoot != true" in message
    assert "seccompProfile" in message
    assert "the engines run vLLM's images as root" in message
    assert message.endswith(
        "Fix: label namespace llm pod-security.kubernetes.io/enforce=baseline (or exempt it)"
    )


def test_a_compliant_container_passes_restricted() -> None:
    spec = {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": "app",
            "securityContext": {"allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}},
        }],
        "volumes": [{"name": "cache", "emptyDir": {}}],
    }  # fmt: skip
    assert pod_violations(spec, PodSecurityLevel.restricted) == []
    spec["volumes"] = [{"name": "host", "hostPath": {"path": "/"}}]
    checks = {v.check for v in pod_violations(spec, PodSecurityLevel.restricted)}
    # restrictedVolumes replaces the baseline hostPath check (OverrideCheckIDs): the API
    # server names only the stricter one.
    assert checks == {"restricted volume types"}
    assert pod_violations(spec, PodSecurityLevel.baseline)[0].check == "hostPath volumes"


def test_rdma_at_restricted_is_unrestricted_capabilities_and_still_needs_privileged() -> None:
    dm = rdma_model()
    message = judged(dm, PodSecurityLevel.restricted)
    assert message is not None
    assert "non-default capabilities" not in message  # overridden by the restricted check
    assert "prefill: allowPrivilegeEscalation != false, runAsNonRoot != true" in message
    assert "unrestricted capabilities" in message
    assert "spec.placement.rdma (capability IPC_LOCK" in message
    assert "pod-security.kubernetes.io/enforce=privileged" in message


def test_a_pass_reports_the_refusal_as_placement_false() -> None:
    dm = rdma_model()
    message = judged(dm, PodSecurityLevel.baseline)
    status = compute_status(
        dm, Observation(pod_security=message), None, generation=1, parity="p", now="t"
    )
    [placement] = [c for c in status.conditions if c.type == "Placement"]
    assert (placement.status, placement.reason, placement.message) == (
        "False",
        "PodSecurity",
        message,
    )


def test_a_node_directory_as_model_cache_needs_privileged_and_a_claim_does_not() -> None:
    def cached(cache: dict[str, str]) -> Any:
        return model(model={"name": "Qwen/Qwen3-8B", "source": {"hf": {"cache": cache}}})

    assert judged(cached({"claimName": "hf-cache"}), PodSecurityLevel.baseline) is None
    message = judged(cached({"hostPath": "/var/lib/hf"}), PodSecurityLevel.baseline)
    assert message is not None
    assert "prefill: hostPath volumes; decode: hostPath volumes" in message
    assert "spec.model.source.hf.cache.hostPath (a hostPath volume)" in message
    assert message.endswith(
        "Fix: label namespace llm pod-security.kubernetes.io/enforce=privileged (or exempt it), "
        "or use a claimName for the model cache"
    )
