"""A multi-node engine pool's workload: one LeaderWorkerSet per slice (the real LWS API,
leaderworkerset.x-k8s.io/v1, as v0.7.0 serves it), each group one replica of nodesPerReplica
pods. Every pod runs the same template (hybrid load balancing: each serves HTTP for its own
ranks), so only workerTemplate is written. Every field LWS would default is written, so a
server-side apply diff stays quiet (docs/design/multinode.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.api import EnginePoolSpec
from pdserve.contract.names import (
    LWS_GROUP_INDEX_LABEL,
    LWS_GROUP_KEY_LABEL,
    LWS_NAME_LABEL,
    LWS_WORKER_INDEX_LABEL,
)

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
# The labels LWS sets on every pod of a group (pdserve.contract.names), by their short names here.
GROUP_KEY_LABEL = LWS_GROUP_KEY_LABEL
NAME_LABEL = LWS_NAME_LABEL
GROUP_INDEX_LABEL = LWS_GROUP_INDEX_LABEL
WORKER_INDEX_LABEL = LWS_WORKER_INDEX_LABEL


def leader_worker_set(
    metadata: dict[str, Any],
    pool: EnginePoolSpec,
    template: dict[str, Any],
    replicas: int | None,
    partition: int,
) -> dict[str, Any]:
    """`replicas`: groups, None when an External autoscaler owns them (through /scale);
    `partition`: groups below it keep the old template (lockstep rollouts, builders/rollout.py)."""
    spec: dict[str, Any] = {} if replicas is None else {"replicas": replicas}
    spec.update({
        "leaderWorkerTemplate": {
            "size": pool.nodes_per_replica,
            # vLLM cannot lose a rank: a restarted or deleted pod recreates its whole group.
            "restartPolicy": "RecreateGroupOnPodRestart",
            "workerTemplate": template,
        },
        # LeaderReady would deadlock: the leader's vLLM waits for the workers' engines before
        # it serves (and so before it is Ready).
        "startupPolicy": "LeaderCreated",
        "networkConfig": {"subdomainPolicy": "Shared"},
        "rolloutStrategy": {
            "type": "RollingUpdate",
            "rollingUpdateConfiguration": {
                "partition": partition, "maxUnavailable": 1, "maxSurge": 0,
            },
        },
    })  # fmt: skip
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}


def group_affinity_term(selector: dict[str, str], topology_key: str) -> dict[str, Any]:
    """Every pod of a group in one topology domain (one NVLink clique): the pool's pods with the
    same group key, whatever the Preferred/Required mode of the slice's own domain term."""
    return {
        "labelSelector": {"matchLabels": selector},
        "matchLabelKeys": [GROUP_KEY_LABEL],
        "topologyKey": topology_key,
    }


def pod_template_of(workload: Mapping[str, Any]) -> dict[str, Any]:
    """The pod template of a Deployment, StatefulSet, Job or LeaderWorkerSet ({} when a live
    object has none)."""
    spec = workload.get("spec") or {}
    if workload.get("kind") == KIND:
        spec = spec.get("leaderWorkerTemplate") or {}
        template: dict[str, Any] = spec.get("workerTemplate") or {}
        return template
    found: dict[str, Any] = spec.get("template") or {}
    return found


def partition_of(workload: Mapping[str, Any]) -> int:
    """The live rollout partition of an engine StatefulSet or LeaderWorkerSet."""
    spec = workload.get("spec") or {}
    if workload.get("kind") == KIND:
        config = (spec.get("rolloutStrategy") or {}).get("rollingUpdateConfiguration") or {}
        return int(config.get("partition", 0))
    return int(((spec.get("updateStrategy") or {}).get("rollingUpdate") or {}).get("partition", 0))
