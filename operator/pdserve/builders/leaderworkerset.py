"""A multi-node engine pool's workload: one LeaderWorkerSet per slice (the real LWS API,
leaderworkerset.x-k8s.io/v1, as v0.7.0 serves it), each group one replica of nodesPerReplica
pods. Every pod runs the same template (hybrid load balancing: each serves HTTP for its own
ranks), so only workerTemplate is written. Every field LWS would default is written, so a
server-side apply diff stays quiet (docs/design/multinode.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.api import EnginePoolSpec

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
# Pods of one group share this label's value (set by LWS's pod webhook).
GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"


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
    """The pod template of a Deployment, StatefulSet, Job or LeaderWorkerSet."""
    spec = workload.get("spec") or {}
    if workload.get("kind") == KIND:
        template: dict[str, Any] = spec["leaderWorkerTemplate"]["workerTemplate"]
        return template
    found: dict[str, Any] = spec["template"]
    return found
