"""Pod-template pieces every pool shares: placement, images, model volume, secrets, probes."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from pdserve.api import PARITY_KNOBS, DisaggregatedModel
from pdserve.api.common import EnvVar
from pdserve.api.overrides import PodOverrides
from pdserve.api.placement import PlacementSpec
from pdserve.api.requirements import ResourceRequirements
from pdserve.builders.names import labels, meta, selector_labels
from pdserve.builders.overrides import with_overrides
from pdserve.builders.vllm_args import CHAT_TEMPLATE_FILE
from pdserve.contract.names import PARITY_HASH_ANNOTATION, Component
from pdserve.contract.pod_layout import (
    CHAT_TEMPLATE_DIR,
    HF_CACHE,
    MODEL_MOUNT,
    NON_ROOT_HOME,
)

NON_ROOT_UID = 10001
"""The user pdserve's images run as (images/Dockerfile). vLLM's images run as root and define
no other user, so the CPU pods name it themselves."""
# Pod Security "restricted" (kubernetes.io/docs/concepts/security/pod-security-standards):
# non-root, a RuntimeDefault seccomp profile, no privilege escalation, every capability dropped.
# The CPU pods (gateway, render) need none of what it forbids.
RESTRICTED_POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": NON_ROOT_UID,
    "runAsGroup": NON_ROOT_UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
# Render and gateway pods need no GPU: keep them off GPU nodes when other nodes have room
# (NVIDIA GPU feature discovery labels GPU nodes nvidia.com/gpu.present=true).
CPU_POOL_AFFINITY: dict[str, Any] = {
    "nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "preference": {"matchExpressions": [
                {"key": "nvidia.com/gpu.present", "operator": "DoesNotExist"},
            ]},
        }],
    },
}  # fmt: skip


def env_list(variables: list[EnvVar]) -> list[dict[str, Any]]:
    return [v.model_dump(by_alias=True, exclude_none=True, mode="json") for v in variables]


def common_env(dm: DisaggregatedModel) -> list[dict[str, Any]]:
    """What every vLLM process needs: the parity variables (the hash seed), and the HF token
    only from its Secret."""
    env: list[dict[str, Any]] = [
        {"name": knob.env, "value": str(knob.value(dm.spec))}
        for knob in PARITY_KNOBS
        if knob.env is not None
    ]
    source = dm.spec.model.source
    if source.pvc is not None:
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    elif source.hf is not None and source.hf.token_secret_ref is not None:
        ref = source.hf.token_secret_ref
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
            }
        )
    return env


def resources(
    spec: ResourceRequirements, extended: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """Quantities as strings, the form the API server stores, so desired and live compare equal.
    Extended resources (GPUs, RDMA devices) go in limits only: Kubernetes sets their requests
    equal."""
    out: dict[str, Any] = {}
    if spec.requests:
        out["requests"] = {k: str(v) for k, v in spec.requests.items()}
    limits = {k: str(v) for k, v in spec.limits.items()}
    for name, count in (extended or {}).items():
        if count:
            limits[name] = str(count)
    if limits:
        out["limits"] = limits
    return out


# Kubernetes' default probe timeout is 1 s: a busy engine (a long prefill holding its event
# loop, a GC pause) or a render server deep in a parse answers /health later than that, and
# six missed liveness probes restart a healthy pod with every request on it. llm-d's P/D
# manifests use the same two numbers.
LIVENESS_TIMEOUT_SECONDS = 5
# Readiness stays quicker to judge: a pod that cannot answer in 2 s should get no new requests.
READINESS_TIMEOUT_SECONDS = 2


def http_probes(path: str, *, slow_start: bool) -> dict[str, Any]:
    """Readiness gates traffic; a startup probe gives model loading up to 30 minutes before
    liveness may restart the container."""
    check = {"httpGet": {"path": path, "port": "http"}}
    probes: dict[str, Any] = {
        "readinessProbe": {**check, "periodSeconds": 5, "timeoutSeconds": READINESS_TIMEOUT_SECONDS,
                           "failureThreshold": 3},
        "livenessProbe": {**check, "periodSeconds": 10, "timeoutSeconds": LIVENESS_TIMEOUT_SECONDS,
                          "failureThreshold": 6},
    }  # fmt: skip
    if slow_start:
        probes["startupProbe"] = {**check, "periodSeconds": 10,
                                  "timeoutSeconds": LIVENESS_TIMEOUT_SECONDS,
                                  "failureThreshold": 180}  # fmt: skip
    return probes


def model_volumes(
    dm: DisaggregatedModel, cache_gib: int | None = None, *, non_root: bool = False
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) for weights/tokenizer and the chat template; `cache_gib` sizes the
    Hugging Face download's emptyDir (None: unsized). `non_root`: the pod runs as NON_ROOT_UID
    with HOME on an emptyDir, which also holds Hugging Face's downloads (root's home is not
    readable to it)."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    pvc = dm.spec.model.source.pvc
    if non_root:
        volumes.append({"name": "home", "emptyDir": {}})
        mounts.append({"name": "home", "mountPath": NON_ROOT_HOME})
    if pvc is not None:
        volumes.append(
            {
                "name": "model",
                "persistentVolumeClaim": {"claimName": pvc.claim_name, "readOnly": True},
            }
        )
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    elif not non_root:
        volumes.append({"name": "hf-cache", **hub_cache_volume(dm, cache_gib)})
        mounts.append({"name": "hf-cache", "mountPath": HF_CACHE})
    template = dm.spec.serving.chat_template
    if template is not None:
        volumes.append(
            {
                "name": "chat-template",
                "configMap": {
                    "name": template.name,
                    "items": [{"key": template.key, "path": CHAT_TEMPLATE_FILE}],
                },
            }
        )
        mounts.append({"name": "chat-template", "mountPath": CHAT_TEMPLATE_DIR, "readOnly": True})
    return volumes, mounts


def hub_cache_volume(dm: DisaggregatedModel, cache_gib: int | None) -> dict[str, Any]:
    """The engines' Hugging Face cache: spec.model.source.hf.cache's claim or node directory,
    else an emptyDir of the pod's own (sized by `cache_gib` when known)."""
    hf = dm.spec.model.source.hf
    cache = hf.cache if hf is not None else None
    if cache is not None and cache.claim_name is not None:
        return {"persistentVolumeClaim": {"claimName": cache.claim_name}}
    if cache is not None and cache.host_path is not None:
        return {"hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}
    return {"emptyDir": {"sizeLimit": f"{cache_gib}Gi"} if cache_gib else {}}


def pod_template(
    dm: DisaggregatedModel,
    component: Component,
    *,
    containers: list[dict[str, Any]],
    volumes: list[dict[str, Any]],
    annotations: dict[str, str],
    node_selector: dict[str, str],
    tolerations: list[dict[str, Any]],
    service_account: str | None = None,
    termination_grace_seconds: int = 30,
    gpu_pool: bool = False,
    affinity: dict[str, Any] | None = None,
    extra_spec: Mapping[str, Any] | None = None,
    overrides: PodOverrides | None = None,
) -> dict[str, Any]:
    """`affinity` is the GPU pools' (from builders.placement); CPU pools get CPU_POOL_AFFINITY
    and run as RESTRICTED_POD_SECURITY; the pool's `overrides` are merged last."""
    # spec.placement is for the GPU engines; CPU pods (render, gateway) must not be pinned to
    # GPU nodes by it.
    placement = dm.spec.placement if gpu_pool else PlacementSpec()
    spec: dict[str, Any] = {}
    if service_account is None:
        spec["automountServiceAccountToken"] = False
    else:
        spec["serviceAccountName"] = service_account
    spec["containers"] = containers
    selector = {**placement.node_selector, **node_selector}
    if selector:
        spec["nodeSelector"] = selector
    all_tolerations = [dict(t) for t in placement.tolerations] + [dict(t) for t in tolerations]
    if all_tolerations:
        spec["tolerations"] = all_tolerations
    if gpu_pool:
        if affinity:
            spec["affinity"] = affinity
    else:
        spec["affinity"] = CPU_POOL_AFFINITY
        spec["securityContext"] = copy.deepcopy(RESTRICTED_POD_SECURITY)
        for container in containers:
            container["securityContext"] = copy.deepcopy(RESTRICTED_CONTAINER_SECURITY)
    spec.update(extra_spec or {})
    if dm.spec.image.pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in dm.spec.image.pull_secrets]
    spec["terminationGracePeriodSeconds"] = termination_grace_seconds
    if volumes:
        spec["volumes"] = volumes
    template = {
        "metadata": {"labels": labels(dm, component), "annotations": annotations},
        "spec": spec,
    }
    return with_overrides(template, overrides) if overrides is not None else template


def pod_annotations(parity: str, extra: dict[str, str]) -> dict[str, str]:
    return {**extra, PARITY_HASH_ANNOTATION: parity}


def pdb(dm: DisaggregatedModel, component: Component, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(dm, component, name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(dm, component)}},
    }
