"""Pure builders: a validated DisaggregatedModel -> the complete desired set of child objects.

No I/O: the same input gives byte-identical output. Owner references and server-side apply are
the controller's business."""

from __future__ import annotations

from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.api.images import DEFAULT_GATEWAY_IMAGE
from pdserve.builders.engines import engine_pool
from pdserve.builders.gateway import endpoint, gateway, routing_config
from pdserve.builders.names import child_name
from pdserve.builders.network import NetworkPolicyOptions, network_policies
from pdserve.builders.parity import content_digest, parity_hash, parity_set
from pdserve.builders.peer_key import peer_key_secret, wants_peer_key
from pdserve.builders.render import render_pool
from pdserve.builders.rollout import RolloutPlan
from pdserve.builders.scaling import ReplicaPlan
from pdserve.contract.names import Component

# Apply order: identities and config before the workloads that use them.
# NetworkPolicies come before the workloads, so no pod of the model starts unprotected.
KIND_ORDER = [
    "ServiceAccount", "Role", "RoleBinding", "NetworkPolicy", "Secret", "ConfigMap", "Service",
    "StatefulSet", "LeaderWorkerSet", "Deployment", "HorizontalPodAutoscaler", "ScaledObject",
    "PodDisruptionBudget", "Job",
]  # fmt: skip


def object_key(obj: dict[str, Any]) -> tuple[int, str, str]:
    return KIND_ORDER.index(obj["kind"]), obj["apiVersion"], obj["metadata"]["name"]


def build_all(
    dm: DisaggregatedModel,
    *,
    chat_template_digest: str | None = None,
    network: NetworkPolicyOptions | None = None,
    plan: ReplicaPlan | None = None,
    peer_key: str | None = None,
    rollout: RolloutPlan | None = None,
    gateway_image: str = DEFAULT_GATEWAY_IMAGE,
) -> list[dict[str, Any]]:
    """Every child object pdserve owns for this resource, in apply order. `network`: also the
    model's NetworkPolicies (None: none, and the operator prunes those it made before).
    `plan`: replicas of Builtin-autoscaled pools (None: their starting counts). `peer_key`: the
    gateways' own key, which the controller derives (used only by a model that
    wants_peer_key); None: no peer-key Secret, and the gateway replicas send their first API
    key to each other, or without one have their holds refused and each admits long prefills
    alone (`pdserve manifests`, which never writes a key into a file).
    `rollout`: engine StatefulSets held mid engine upgrade (None: none). `gateway_image`:
    the gateway's image when spec.image.gateway names none (the operator's own)."""
    parity = parity_hash(dm, chat_template_digest)
    objects: list[dict[str, Any]] = []
    if dm.spec.disaggregated:
        assert dm.spec.prefill is not None
        objects += engine_pool(dm, Component.prefill, dm.spec.prefill, parity, plan, rollout)
    objects += engine_pool(dm, Component.decode, dm.spec.decode, parity, plan, rollout)
    if dm.spec.render.enabled:
        objects += render_pool(dm, parity, plan)
    key = peer_key if wants_peer_key(dm) else None
    if key is not None:
        objects.append(peer_key_secret(dm, key))
    objects += gateway(dm, parity, key, dm.spec.image.gateway or gateway_image)
    if network is not None:
        objects += network_policies(dm, network)
    return sorted(objects, key=object_key)


__all__ = [
    "KIND_ORDER",
    "Component",
    "NetworkPolicyOptions",
    "ReplicaPlan",
    "RolloutPlan",
    "build_all",
    "child_name",
    "content_digest",
    "endpoint",
    "network_policies",
    "object_key",
    "parity_hash",
    "parity_set",
    "peer_key_secret",
    "routing_config",
    "wants_peer_key",
]
