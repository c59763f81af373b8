"""The real LeaderWorkerSet controller (sigs.k8s.io/lws v0.7.0, devtools/lws.py) on the local
plane, and the LWS behaviours pdserve's multi-node design relies on (docs/design/multinode.md,
sections 3 and 5), seen as a user of LWS sees them: groups of pods on kwok GB200 NVL72 trays,
their labels and LWS_* env, one NVLink clique per group, a group recreated when one of its pods
goes, a partitioned rollout, and /scale.

Each LeaderWorkerSet has its own trays (a label of its own, a taint that keeps every other pod off,
cliques of its own), so no test waits for another's pods to go and other modules' nodes stay
untouched.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from devtools.localplane import ControlPlaneError, wait_until
from devtools.lws import (
    API_VERSION,
    GROUP_INDEX_LABEL,
    GROUP_KEY_LABEL,
    NAME_LABEL,
    WORKER_INDEX_LABEL,
    LwsManager,
    lws_path,
)
from devtools.nodes import (
    GPU_RESOURCE,
    NVLINK_CLIQUE_LABEL,
    gb200_nvl72_node,
)
from tests.support.plane_scopes import namespace_held, nodes_held

pytestmark = pytest.mark.cluster

# A fabric of this module's own (GFD's "<ClusterUUID>.<CliqueId>"): no other module's clique.
FABRIC = "c0ffee00-1e57-4a1d-9b1a-0000000000aa"
POOL_LABEL = "pdserve.io/lws-test-pool"
TAINT = {"key": "pdserve.io/lws-test", "value": "true", "effect": "NoSchedule"}
# Trays per clique: 4, twice a group. A required podAffinity reserves nothing: with 2 trays a
# clique, two groups' leaders can take one clique and leave neither worker room in it (a first
# run with 2 had three of four LeaderWorkerSets short of Ready groups after 30 s). Each pool:
# its number of cliques.
TRAYS_PER_CLIQUE = 4
POOLS = {"groups": 2, "restart": 1, "rollout": 1, "scale": 2}
GROUP_SIZE = 2
WAIT = 30.0
# Every tray's rank in a preferred nodeAffinity of every pod, interleaving the cliques two trays
# at a time (c0-0, c0-1, c1-0, c1-1, c0-2, ...): the two leaders, scheduled first, take c0-0
# and c0-1, and left to that preference their workers would take c1-0 and c1-1, splitting both
# groups. Only the required podAffinity keeps a group in one clique.
RANK_LABEL = "pdserve.io/lws-test-rank"


def tray_rank(clique: int, tray: int, cliques: int) -> int:
    return (tray // 2) * 2 * cliques + clique * 2 + tray % 2


@dataclass(frozen=True)
class Pool:
    name: str
    cliques: tuple[str, ...]


def _pools() -> dict[str, Pool]:
    pools, clique_id = {}, 0
    for name, count in POOLS.items():
        cliques = tuple(f"{FABRIC}.{clique_id + i}" for i in range(count))
        pools[name] = Pool(name, cliques)
        clique_id += count
    return pools


POOL_CLIQUES = _pools()


@pytest.fixture(scope="module")
def trays(http: httpx.Client) -> Iterator[dict[str, str]]:
    """This module's GB200 trays, Ready: node name -> clique. Removed after the module."""
    nodes = [
        gb200_nvl72_node(
            f"lws-{pool.name}-c{c}-{i}",
            clique=clique,
            labels={
                POOL_LABEL: pool.name,
                RANK_LABEL: str(tray_rank(c, i, len(pool.cliques))),
            },
            taints=(TAINT,),
        )
        for pool in POOL_CLIQUES.values()
        for c, clique in enumerate(pool.cliques)
        for i in range(TRAYS_PER_CLIQUE)
    ]
    with nodes_held(http, nodes):
        yield {n.name: n.nvlink_clique or "" for n in nodes}


@pytest.fixture(scope="module")
def lws_namespace(
    http: httpx.Client, lws_manager: LwsManager, trays: dict[str, str]
) -> Iterator[str]:
    """The module's namespace; deleted with its pods gone before the trays go (kwok finishes a
    pod's deletion only while it manages the pod's node)."""
    with namespace_held(http, f"lws-{secrets.token_hex(4)}") as name:
        yield name


# ---- helpers ---------------------------------------------------------------------------------


def leader_worker_set(name: str, namespace: str, pool: str, *, replicas: int = 2) -> dict[str, Any]:
    """An LWS as pdserve would write it (every field set: section 5), its pods 4 GPUs each
    (one GB200 tray), each group required in one NVLink clique."""
    pod = {
        "metadata": {"labels": {"app": name}},
        "spec": {
            "containers": [{
                "name": "engine", "image": "registry.invalid/engine:1",
                "resources": {"limits": {GPU_RESOURCE: "4"}, "requests": {GPU_RESOURCE: "4"}},
            }],
            "nodeSelector": {POOL_LABEL: pool},
            "tolerations": [{"key": TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
                    "labelSelector": {"matchLabels": {"app": name}},
                    "matchLabelKeys": [GROUP_KEY_LABEL],
                    "topologyKey": NVLINK_CLIQUE_LABEL,
                }]},
                "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 100 - 10 * rank, "preference": {"matchExpressions": [
                        {"key": RANK_LABEL, "operator": "In", "values": [str(rank)]}]}}
                    for rank in range(TRAYS_PER_CLIQUE * max(POOLS.values()))
                ]},
            },
        },
    }  # fmt: skip
    return {
        "apiVersion": API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "networkConfig": {"subdomainPolicy": "Shared"},
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"partition": 0, "maxUnavailable": 1, "maxSurge": 0},
            },
            "leaderWorkerTemplate": {
                "size": GROUP_SIZE,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": pod,
            },
        },
    }


def create(http: httpx.Client, namespace: str, pool: str, *, replicas: int = 2) -> str:
    name = f"{pool}-{secrets.token_hex(2)}"
    body = leader_worker_set(name, namespace, pool, replicas=replicas)
    response = http.post(lws_path(namespace), json=body)
    assert response.status_code == 201, response.text
    return name


def pods(http: httpx.Client, namespace: str, name: str) -> dict[str, dict[str, Any]]:
    """The LWS's pods not being deleted, by name."""
    items = http.get(
        f"/api/v1/namespaces/{namespace}/pods", params={"labelSelector": f"{NAME_LABEL}={name}"}
    ).json()["items"]
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


def running_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
    return status.get("phase") == "Running" and ready


def status(http: httpx.Client, namespace: str, name: str) -> dict[str, Any]:
    return dict(http.get(lws_path(namespace, name)).json().get("status") or {})


def pod_names(name: str, groups: int) -> set[str]:
    """Leader <lws>-<group>, workers <lws>-<group>-<worker>."""
    return {
        f"{name}-{g}" + (f"-{w}" if w else "") for g in range(groups) for w in range(GROUP_SIZE)
    }


def wait_groups_ready(http: httpx.Client, namespace: str, name: str, groups: int) -> None:
    """Every group's pods Running and Ready, and the LWS counting them all ready."""

    def ready() -> bool:
        found = pods(http, namespace, name)
        return (
            set(found) == pod_names(name, groups)
            and all(running_ready(p) for p in found.values())
            and status(http, namespace, name).get("readyReplicas") == groups
        )

    try:
        wait_until(f"{groups} ready groups of LWS {name}", ready, timeout=WAIT)
    except ControlPlaneError as exc:
        where = {n: (p["status"].get("phase"), p["spec"].get("nodeName"))
                 for n, p in pods(http, namespace, name).items()}  # fmt: skip
        raise AssertionError(f"{exc}; pods (phase, node): {where}") from exc


def uids(found: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {name: pod["metadata"]["uid"] for name, pod in found.items()}


def env(pod: dict[str, Any]) -> dict[str, str]:
    [container] = pod["spec"]["containers"]
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def merge_patch(http: httpx.Client, path: str, body: dict[str, Any]) -> None:
    response = http.patch(path, json=body, headers={"Content-Type": "application/merge-patch+json"})
    assert response.is_success, response.text


@pytest.fixture(scope="module")
def groups_lws(http: httpx.Client, lws_namespace: str, trays: dict[str, str]) -> str:
    """2 groups x 2 pods on the "groups" trays, all Ready: shared by the read-only tests."""
    name = create(http, lws_namespace, "groups")
    wait_groups_ready(http, lws_namespace, name, 2)
    return name


# ---- tests -----------------------------------------------------------------------------------


def test_groups_get_labels_env_and_ready_count(
    http: httpx.Client, lws_namespace: str, groups_lws: str, trays: dict[str, str]
) -> None:
    name, ns = groups_lws, lws_namespace
    found = pods(http, ns, name)
    assert set(found) == pod_names(name, 2)
    group_keys: dict[int, set[str]] = {}
    for group in range(2):
        for worker in range(GROUP_SIZE):
            pod = found[f"{name}-{group}" + (f"-{worker}" if worker else "")]
            assert running_ready(pod), pod["status"]
            labels = pod["metadata"]["labels"]
            assert labels[GROUP_INDEX_LABEL] == str(group)
            assert labels[WORKER_INDEX_LABEL] == str(worker)
            assert labels[GROUP_KEY_LABEL]
            group_keys.setdefault(group, set()).add(labels[GROUP_KEY_LABEL])
            assert env(pod) == {
                "LWS_LEADER_ADDRESS": f"{name}-{group}.{name}.{ns}",
                "LWS_GROUP_SIZE": str(GROUP_SIZE),
                "LWS_WORKER_INDEX": str(worker),
            }
            assert pod["spec"]["nodeName"] in trays
    # One key per group, a different one for each group.
    assert all(len(keys) == 1 for keys in group_keys.values())
    assert group_keys[0] != group_keys[1]
    # One tray per pod: 4 GPUs each.
    assert len({p["spec"]["nodeName"] for p in found.values()}) == 4
    current = status(http, ns, name)
    assert current["readyReplicas"] == 2
    assert current["replicas"] == 2


def test_each_group_lands_in_one_clique(
    http: httpx.Client, lws_namespace: str, groups_lws: str, trays: dict[str, str]
) -> None:
    found = pods(http, lws_namespace, groups_lws)
    cliques: dict[str, set[str]] = {}
    for pod in found.values():
        group = pod["metadata"]["labels"][GROUP_INDEX_LABEL]
        cliques.setdefault(group, set()).add(trays[pod["spec"]["nodeName"]])
    assert set(cliques) == {"0", "1"}
    assert all(len(c) == 1 for c in cliques.values()), cliques


def test_deleting_a_worker_recreates_its_whole_group(
    http: httpx.Client, lws_namespace: str, trays: dict[str, str]
) -> None:
    ns = lws_namespace
    name = create(http, ns, "restart")
    wait_groups_ready(http, ns, name, 2)
    before = uids(pods(http, ns, name))

    response = http.delete(f"/api/v1/namespaces/{ns}/pods/{name}-1-1")
    assert response.is_success, response.text

    def group_1_recreated() -> bool:
        now = uids(pods(http, ns, name))
        return (
            set(now) == set(before)
            and now[f"{name}-1"] != before[f"{name}-1"]
            and now[f"{name}-1-1"] != before[f"{name}-1-1"]
        )

    wait_until("group 1 recreated, its leader too", group_1_recreated, timeout=WAIT)
    wait_groups_ready(http, ns, name, 2)
    after = uids(pods(http, ns, name))
    assert after[f"{name}-0"] == before[f"{name}-0"]
    assert after[f"{name}-0-1"] == before[f"{name}-0-1"]
    assert after[f"{name}-1"] != before[f"{name}-1"]


def test_partition_holds_lower_groups_then_rolls_them(
    http: httpx.Client, lws_namespace: str, trays: dict[str, str]
) -> None:
    ns = lws_namespace
    name = create(http, ns, "rollout")
    wait_groups_ready(http, ns, name, 2)
    before = uids(pods(http, ns, name))
    annotation = "pdserve.io/kv-compat"

    def annotated(found: dict[str, dict[str, Any]], pod: str) -> bool:
        return (found[pod]["metadata"].get("annotations") or {}).get(annotation) == "new"

    merge_patch(http, lws_path(ns, name), {"spec": {
        "rolloutStrategy": {"rollingUpdateConfiguration": {"partition": 1}},
        "leaderWorkerTemplate": {"workerTemplate": {"metadata": {"annotations": {
            annotation: "new"}}}},
    }})  # fmt: skip

    def group_1_rolled() -> bool:
        found = pods(http, ns, name)
        return (
            set(found) == pod_names(name, 2)
            and all(annotated(found, p) for p in (f"{name}-1", f"{name}-1-1"))
            and all(running_ready(p) for p in found.values())
            and status(http, ns, name).get("updatedReplicas") == 1
            and status(http, ns, name).get("readyReplicas") == 2
        )

    wait_until("group 1 on the new template", group_1_rolled, timeout=WAIT)
    held = pods(http, ns, name)
    for pod in (f"{name}-0", f"{name}-0-1"):
        assert held[pod]["metadata"]["uid"] == before[pod]
        assert not annotated(held, pod)

    merge_patch(http, lws_path(ns, name), {"spec": {"rolloutStrategy": {
        "rollingUpdateConfiguration": {"partition": 0}}}})  # fmt: skip

    def all_rolled() -> bool:
        found = pods(http, ns, name)
        return (
            set(found) == pod_names(name, 2)
            and all(annotated(found, p) for p in found)
            and all(running_ready(p) for p in found.values())
            and status(http, ns, name).get("updatedReplicas") == 2
            and status(http, ns, name).get("readyReplicas") == 2
        )

    wait_until("group 0 on the new template too", all_rolled, timeout=WAIT)
    after = uids(pods(http, ns, name))
    assert all(after[p] != before[p] for p in (f"{name}-0", f"{name}-0-1"))


def test_scale_subresource_adds_a_group(
    http: httpx.Client, lws_namespace: str, trays: dict[str, str]
) -> None:
    ns = lws_namespace
    name = create(http, ns, "scale")
    wait_groups_ready(http, ns, name, 2)
    scale = http.get(f"{lws_path(ns, name)}/scale").json()
    assert scale["spec"]["replicas"] == 2
    # HPA's selector: the leaders only.
    assert scale["status"]["selector"] == f"{NAME_LABEL}={name},{WORKER_INDEX_LABEL}=0"

    merge_patch(http, f"{lws_path(ns, name)}/scale", {"spec": {"replicas": 3}})
    wait_groups_ready(http, ns, name, 3)
    found = pods(http, ns, name)
    third = [p for p in found.values() if p["metadata"]["labels"][GROUP_INDEX_LABEL] == "2"]
    assert {p["metadata"]["name"] for p in third} == {f"{name}-2", f"{name}-2-1"}
    # Together in one clique, as the first two groups.
    cliques = {trays[p["spec"]["nodeName"]] for p in third}
    assert len(cliques) == 1
    assert http.get(f"{lws_path(ns, name)}/scale").json()["spec"]["replicas"] == 3
