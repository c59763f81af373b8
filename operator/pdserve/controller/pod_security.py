"""Whether the model's namespace lets its pods in: read the namespace's Pod Security level and
judge the templates pdserve would apply (builders/pod_security.py). The webhook refuses such a
spec at apply time; a pass reports it in the Placement condition (the namespace may have been
relabelled after the apply)."""

from __future__ import annotations

from pdserve.api import DisaggregatedModel
from pdserve.builders import build_all
from pdserve.builders.pod_security import (
    PodSecurityLevel,
    enforced_level,
    pod_security_problem,
    refused_templates,
)
from pdserve.controller.cache import NAMESPACE, ClusterCache
from pdserve.kube.client import Kube


async def namespace_level(
    kube: Kube, namespace: str, cache: ClusterCache | None = None
) -> PodSecurityLevel:
    """From the namespaces' watch when it runs (a pass asks the API server nothing), else
    asked."""
    labels = cache.namespace_labels(namespace) if cache is not None else None
    if labels is None:
        found = await kube.get(NAMESPACE, None, namespace)
        labels = (found or {}).get("metadata", {}).get("labels") or {}
    return enforced_level(labels)


def judged(dm: DisaggregatedModel, level: PodSecurityLevel) -> str | None:
    """The refusal message for `dm`'s pods at `level`, or None when they are admitted."""
    if level is PodSecurityLevel.privileged:
        return None
    refused = refused_templates(build_all(dm), level)
    return pod_security_problem(dm.namespace, level, refused)


async def pod_security_refusal(
    kube: Kube, dm: DisaggregatedModel, cache: ClusterCache | None = None
) -> str | None:
    return judged(dm, await namespace_level(kube, dm.namespace, cache))
