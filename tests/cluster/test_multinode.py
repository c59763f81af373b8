"""The operator with replicas that span nodes (nodesPerReplica, docs/design/multinode.md), with
the real LeaderWorkerSet controller (v0.7.0, devtools/lws.py) on kwok GB200 NVL72 trays: each
replica a group in one NVLink clique, its pods wired by LWS's env, the model's status counting
groups; a deleted worker recreates its whole group; an engine upgrade rolls prefill and decode
groups in lockstep by KV-compatibility digest.

The module's trays carry a label and a taint of their own (other modules' pods stay off them, the
model's engines select and tolerate them) and a fabric of their own: two cliques of 10 trays. A
required podAffinity reserves nothing: a model's leaders, created first, may all bind in one
clique, and their workers must then find room beside them (with 4 trays a clique, two workers
stayed Pending: the model reports it, test_a_group_short_of_room_is_not_ready). So each clique
holds the module's model (6 trays) and the autoscaling test's (4) at once: with 6 trays a clique
the latter's two leaders once bound in the clique the first model mostly filled, and their
workers found no room (1 run in 6)."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from devtools.localplane import ControlPlane, wait_until
from devtools.lws import (
    GROUP_INDEX_LABEL,
    GROUP_KEY_LABEL,
    NAME_LABEL,
    WORKER_INDEX_LABEL,
    LwsManager,
    lws_path,
)
from devtools.nodes import gb200_nvl72_node
from devtools.operator_proc import RunningOperator
from devtools.resources import apply_dm, conditions, dm_url, get
from pdserve.builders.leaderworkerset import partition_of
from pdserve.contract.names import COMPONENT_LABEL, KV_COMPAT_ANNOTATION
from tests.support.plane_scopes import namespace_held, nodes_held

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("dm_crd")]

RESYNC_SECONDS = 2
FABRIC = "c0ffee00-1e57-4a1d-9b1a-0000000000bb"
POOL_LABEL = "pdserve.io/multinode-test"
TAINT = {"key": "pdserve.io/multinode-test", "value": "true", "effect": "NoSchedule"}
TRAY_LABELS = {POOL_LABEL: "true"}
CLIQUES = (f"{FABRIC}.0", f"{FABRIC}.1")
TRAYS_PER_CLIQUE = 10
WAIT = 60.0
ENGINES = ("prefill", "decode")

# 1 prefill group and 2 decode groups, 2 trays each: 6 of the 20 trays. DeepSeek-R1's shape is
# not known to pdserve (MoE, not judged by the memory fit).
SPEC: dict[str, Any] = {
    "model": {"name": "deepseek-ai/DeepSeek-R1-0528"},
    "prefill": {"replicas": 1, "nodesPerReplica": 2, "dataParallelSize": 8,
                "expertParallel": {"all2allBackend": "deepep_high_throughput"}},
    "decode": {"replicas": 2, "nodesPerReplica": 2, "dataParallelSize": 8,
               "expertParallel": {"all2allBackend": "deepep_low_latency"}},
    "render": {"enabled": False},
    "gateway": {"replicas": 1},
    "placement": {
        "gpuProducts": ["NVIDIA-GB200"],
        "nodeSelector": {POOL_LABEL: "true"},
        "tolerations": [{"key": TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}],
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def trays(http: httpx.Client) -> Iterator[dict[str, str]]:
    """This module's trays, Ready: node name -> clique. Removed after the module."""
    nodes = [
        gb200_nvl72_node(f"mn-c{c}-{i}", clique=clique, labels=TRAY_LABELS, taints=(TAINT,))
        for c, clique in enumerate(CLIQUES)
        for i in range(TRAYS_PER_CLIQUE)
    ]
    with nodes_held(http, nodes):
        yield {n.name: n.nvlink_clique or "" for n in nodes}


@pytest.fixture(scope="module")
def model(
    http: httpx.Client, lws_manager: LwsManager, trays: dict[str, str],
    operator: RunningOperator,
) -> Iterator[tuple[str, str]]:  # fmt: skip
    """(namespace, name) of the module's model, Ready; its pods gone before the trays go."""
    name = "wide"
    with namespace_held(http, f"mn-{secrets.token_hex(4)}") as namespace:
        apply_dm(http, namespace, name, SPEC)
        wait_until("the wide-EP model Ready", lambda: ready(http, namespace, name),
                   timeout=WAIT)  # fmt: skip
        yield namespace, name


def ready(http: httpx.Client, namespace: str, name: str) -> bool:
    dm = get(http, dm_url(namespace, name)) or {}
    return (
        conditions(dm).get("Ready", {}).get("status") == "True"
        and dm["status"].get("observedGeneration") == dm["metadata"]["generation"]
    )


def engine_pods(http: httpx.Client, namespace: str) -> list[dict[str, Any]]:
    pods = http.get(f"/api/v1/namespaces/{namespace}/pods").json()["items"]
    return [
        p for p in pods
        if p["metadata"]["labels"].get(COMPONENT_LABEL) in ENGINES
        and NAME_LABEL in p["metadata"]["labels"]
        and not p["metadata"].get("deletionTimestamp")
    ]  # fmt: skip


def groups(pods: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(LeaderWorkerSet, group index) -> its pods."""
    found: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for pod in pods:
        labels = pod["metadata"]["labels"]
        found.setdefault((labels[NAME_LABEL], labels[GROUP_INDEX_LABEL]), []).append(pod)
    return found


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    [vllm] = [c for c in pod["spec"]["containers"] if c["name"] == "vllm"]
    return {e["name"]: e.get("value", "") for e in vllm.get("env", [])}


@pytest.mark.usefixtures("lws_manager", "operator")
def test_a_group_short_of_room_is_not_ready_and_placement_names_its_pending_worker(
    http: httpx.Client, trays: dict[str, str]
) -> None:
    """One tray for a group of two whole-tray pods: the leader binds, the worker cannot. LWS
    v0.7.0 counts the group ready anyway; the model must not."""
    name = "short"
    tray = sorted(trays)[-1]
    placement = {**SPEC["placement"], "nodeSelector": {
        POOL_LABEL: "true", "kubernetes.io/hostname": tray,
    }}  # fmt: skip
    spec = {**SPEC, "prefill": {"replicas": 0}, "decode": {**SPEC["decode"], "replicas": 1},
            "placement": placement}  # fmt: skip
    with namespace_held(http, f"mn-short-{secrets.token_hex(3)}") as namespace:
        apply_dm(http, namespace, name, spec)

        def leader_up_worker_pending() -> bool:
            pods = {p["metadata"]["name"]: p for p in engine_pods(http, namespace)}
            leader, worker = pods.get(f"{name}-decode-0"), pods.get(f"{name}-decode-0-1")
            dm = get(http, dm_url(namespace, name)) or {}
            placed = conditions(dm).get("Placement", {})
            return (
                leader is not None and pod_ready(leader)
                and worker is not None and not worker["spec"].get("nodeName")
                and placed.get("status") == "False"
            )  # fmt: skip

        wait_until("the leader Ready, its worker Pending", leader_up_worker_pending, timeout=WAIT)
        dm = get(http, dm_url(namespace, name)) or {}
        decode = dm["status"]["pools"]["decode"]
        assert (decode["ready"], decode["desired"]) == (0, 1)
        assert conditions(dm)["Ready"]["status"] == "False"
        placed = conditions(dm)["Placement"]["message"]
        assert f"{name}-decode-0-1" in placed
        # The leader holds the only tray; the scheduler will not move it: the fix is named.
        assert f"Group leaders bound where their workers do not fit: {name}-decode-0 on {tray}" in (
            placed
        )
        assert "delete the leader pod" in placed


def test_each_replica_is_a_group_of_pods_in_one_clique_and_the_status_counts_groups(
    http: httpx.Client, model: tuple[str, str], trays: dict[str, str]
) -> None:
    namespace, name = model
    for pool, replicas in (("prefill", 1), ("decode", 2)):
        lws = get(http, lws_path(namespace, f"{name}-{pool}"))
        assert lws is not None, pool
        [owner] = lws["metadata"]["ownerReferences"]
        assert owner["kind"] == "DisaggregatedModel"
        assert (lws["spec"]["replicas"], lws["spec"]["leaderWorkerTemplate"]["size"]) == (
            replicas, 2,
        )  # fmt: skip
    found = groups(engine_pods(http, namespace))
    assert sorted(found) == [(f"{name}-decode", "0"), (f"{name}-decode", "1"),
                             (f"{name}-prefill", "0")]  # fmt: skip
    for (lws_name, index), members in found.items():
        assert len(members) == 2, (lws_name, index)
        cliques = {trays[p["spec"]["nodeName"]] for p in members}
        assert len(cliques) == 1, f"group {lws_name}/{index} split over cliques {cliques}"
        assert len({p["metadata"]["labels"][GROUP_KEY_LABEL] for p in members}) == 1
        for pod in members:
            worker = pod["metadata"]["labels"][WORKER_INDEX_LABEL]
            env = env_of(pod)
            # What vLLM's --node-rank $(LWS_WORKER_INDEX) and --data-parallel-address
            # $(LWS_LEADER_ADDRESS) are expanded from, set by LWS's pod webhook.
            assert (env["LWS_GROUP_SIZE"], env["LWS_WORKER_INDEX"]) == ("2", worker)
            # <leader pod>.<subdomain: the LeaderWorkerSet's name, pdserve's headless Service>
            assert env["LWS_LEADER_ADDRESS"] == f"{lws_name}-{index}.{lws_name}.{namespace}"
            assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    dm = get(http, dm_url(namespace, name)) or {}
    pools = dm["status"]["pools"]
    assert (pools["prefill"]["ready"], pools["prefill"]["desired"]) == (1, 1)
    assert (pools["decode"]["ready"], pools["decode"]["desired"]) == (2, 2)
    assert (pools["prefill"]["summary"], pools["decode"]["summary"]) == ("1/1 groups", "2/2 groups")


def test_a_deleted_worker_recreates_its_whole_group_and_the_model_comes_back(
    http: httpx.Client, model: tuple[str, str]
) -> None:
    namespace, name = model
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in engine_pods(http, namespace)}
    worker = f"{name}-decode-1-1"
    assert worker in before
    http.delete(f"/api/v1/namespaces/{namespace}/pods/{worker}").raise_for_status()

    def group_recreated() -> bool:
        now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in engine_pods(http, namespace)}
        return (
            set(now) == set(before)
            and now[f"{name}-decode-1"] != before[f"{name}-decode-1"]  # the leader too
            and now[worker] != before[worker]
        )

    wait_until("decode group 1 recreated", group_recreated, timeout=WAIT)
    now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in engine_pods(http, namespace)}
    untouched = [n for n in before if not n.startswith(f"{name}-decode-1")]
    assert {n: now[n] for n in untouched} == {n: before[n] for n in untouched}
    wait_until("the model Ready again", lambda: ready(http, namespace, name), timeout=WAIT)


def evict(http: httpx.Client, namespace: str, pod: str) -> int:
    """POST the pod's eviction (what `kubectl drain` does): 201 allowed, 429 refused by a PDB."""
    body = {"apiVersion": "policy/v1", "kind": "Eviction",
            "metadata": {"name": pod, "namespace": namespace}}  # fmt: skip
    return http.post(f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction", json=body).status_code


def test_a_drain_takes_one_group_at_a_time_and_the_group_comes_back_whole(
    http: httpx.Client, model: tuple[str, str]
) -> None:
    """The pool's PodDisruptionBudget (maxUnavailable 1 over its pods) lets one eviction through;
    the evicted worker's whole group is recreated, and while it is, another group's pod is not
    evicted."""
    namespace, name = model
    pdb = f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{name}-decode"

    def budget_settled() -> bool:
        """The disruption controller has counted the 4 decode pods as they are now: right
        after the previous test's recreated group its status may still count the old pods too
        (then it allows two evictions, and the API server goes by the status)."""
        budget = get(http, pdb) or {}
        status = budget.get("status", {})
        return (
            status.get("observedGeneration") == budget["metadata"]["generation"]
            and (status.get("expectedPods"), status.get("currentHealthy")) == (4, 4)
            and status.get("disruptionsAllowed") == 1
        )

    wait_until("the decode PodDisruptionBudget counting 4 healthy pods", budget_settled,
               timeout=WAIT)  # fmt: skip
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in engine_pods(http, namespace)}
    assert evict(http, namespace, f"{name}-decode-0-1") == 201
    assert evict(http, namespace, f"{name}-decode-1-1") == 429

    def group_back() -> bool:
        now = {p["metadata"]["name"]: p for p in engine_pods(http, namespace)}
        leader = now.get(f"{name}-decode-0")
        return (
            set(now) == set(before) and leader is not None
            and leader["metadata"]["uid"] != before[f"{name}-decode-0"]  # the whole group
            and all(map(pod_ready, now.values()))
        )  # fmt: skip

    wait_until("decode group 0 recreated and Ready", group_back, timeout=WAIT)
    now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in engine_pods(http, namespace)}
    assert now[f"{name}-decode-1-1"] == before[f"{name}-decode-1-1"]  # never evicted
    wait_until("the model Ready again", lambda: ready(http, namespace, name), timeout=WAIT)


def test_an_engine_upgrade_rolls_groups_in_lockstep_never_leaving_a_digest_unpaired(
    control_plane: ControlPlane, http: httpx.Client, model: tuple[str, str]
) -> None:
    """While the groups move to a new engine image (a new KV-compatibility digest), the
    operator holds each LeaderWorkerSet's partition so that decode leads by one group and
    prefill follows, and every digest a Ready prefill group runs has a Ready decode group on it
    too, in every observed state."""
    namespace, name = model
    old = {p["metadata"]["annotations"][KV_COMPAT_ANNOTATION] for p in engine_pods(http, namespace)}
    seen: list[dict[str, set[str]]] = []
    held: dict[str, set[int]] = {"prefill": set(), "decode": set()}
    stop = threading.Event()

    def observe() -> None:
        with control_plane.http() as watcher:
            while not stop.is_set():
                seen.append(ready_digests(engine_pods(watcher, namespace)))
                for pool in held:
                    lws = get(watcher, lws_path(namespace, f"{name}-{pool}")) or {}
                    held[pool].add(partition_of(lws))

    thread = threading.Thread(target=observe, daemon=True)
    thread.start()
    try:
        apply_dm(http, namespace, name, {**SPEC, "image": {"engine": "vllm/vllm-openai:v0.32.1"}})

        def rolled() -> bool:
            pods = engine_pods(http, namespace)
            digests = {p["metadata"]["annotations"][KV_COMPAT_ANNOTATION] for p in pods}
            return len(pods) == 6 and not digests & old and ready(http, namespace, name)

        wait_until("every group on the new digest and the model Ready", rolled, timeout=WAIT * 2)
    finally:
        stop.set()
        thread.join(timeout=10)
    # Decode group 1 rolled first (partition 1) while the prefill group waited (partition 1 of
    # 1); then prefill, then decode's last group.
    assert held == {"prefill": {0, 1}, "decode": {0, 1}}, held
    # Every state, including those where a pool has no Ready group at all. (This held only once
    # the fake nodes finished deletions by UID, as kubelets do: kwok's deletions by name removed
    # freshly re-created pods, and LWS recreated a new decode group over and over; see
    # devtools/pod_finisher.py.)
    unpaired = [s for s in seen if not s["prefill"] <= s["decode"]]
    assert not unpaired, unpaired[:3]
    assert any(len(state["decode"]) == 2 for state in seen), "never saw both digests serving"


def ready_digests(pods: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Per pool, the digests of its groups whose every pod is Ready."""
    found: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    for members in groups(pods).values():
        digests = {p["metadata"]["annotations"].get(KV_COMPAT_ANNOTATION) for p in members}
        if len(members) == 2 and len(digests) == 1 and all(map(pod_ready, members)):
            pool = members[0]["metadata"]["labels"][COMPONENT_LABEL]
            found[pool] |= {d for d in digests if d}
    return found


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def test_the_builtin_autoscaler_holds_a_pool_in_whole_groups(
    http: httpx.Client, model: tuple[str, str]
) -> None:
    """A Builtin-scaled multi-node pool is planned in groups: below minReplicas, the operator
    writes the LeaderWorkerSet's replicas up to it and LWS creates whole groups. (The loop's
    own decisions, from per-rank metrics, are tested in tests/unit/controller/test_autoscale.py:
    kwok pods serve no /metrics.)"""
    name = "scaled"
    decode = {**SPEC["decode"], "replicas": 1,
              "autoscaling": {"engine": "Builtin", "minReplicas": 2, "maxReplicas": 3}}  # fmt: skip
    spec = {**SPEC, "prefill": {"replicas": 0}, "decode": decode,
            "gateway": {"replicas": 1, "slo": {"itlMs": 50}}}  # fmt: skip
    with namespace_held(http, f"mn-scaled-{secrets.token_hex(3)}") as namespace:
        apply_dm(http, namespace, name, spec)
        wait_until("the model Ready", lambda: ready(http, namespace, name), timeout=WAIT)
        lws = get(http, lws_path(namespace, f"{name}-decode")) or {}
        assert lws["spec"]["replicas"] == 2
        found = groups(engine_pods(http, namespace))
        assert sorted(found) == [(f"{name}-decode", "0"), (f"{name}-decode", "1")]
        assert all(len(members) == 2 for members in found.values())
        pools = (get(http, dm_url(namespace, name)) or {})["status"]["pools"]
        assert pools["decode"]["summary"] == "2/2 groups"
