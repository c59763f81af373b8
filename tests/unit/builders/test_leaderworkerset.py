"""A pool whose replica spans nodes is a LeaderWorkerSet per slice: its groups, template,
vLLM's multi-node flags, every rank's port and the group's placement; single-node pools keep
their StatefulSets."""

from __future__ import annotations

import copy
from typing import Any

from pdserve.api import DisaggregatedModel, parse_resource
from pdserve.builders import RolloutPlan, build_all
from pdserve.builders.leaderworkerset import GROUP_KEY_LABEL, pod_template_of
from tests.support.specs import GPU_POOLS

CLIQUE = "nvidia.com/gpu.clique"


def model(decode: dict[str, Any], **spec: Any) -> DisaggregatedModel:
    body = copy.deepcopy(GPU_POOLS)
    body["spec"]["decode"].update(decode)
    body["spec"].update(spec)
    return parse_resource(body)


WIDE = {"nodesPerReplica": 4, "dataParallelSize": 16, "replicas": 2}


def workloads(dm: DisaggregatedModel, **kwargs: Any) -> dict[str, dict[str, Any]]:
    kinds = ("StatefulSet", "LeaderWorkerSet")
    return {o["metadata"]["name"]: o for o in build_all(dm, **kwargs) if o["kind"] in kinds}


def container(workload: dict[str, Any]) -> dict[str, Any]:
    [vllm] = pod_template_of(workload)["spec"]["containers"]
    found: dict[str, Any] = vllm
    return found


def test_a_multi_node_pool_is_a_leader_worker_set_and_the_other_pool_stays_a_statefulset() -> None:
    found = workloads(model(WIDE))
    assert {name: o["kind"] for name, o in found.items()} == {
        "m-decode": "LeaderWorkerSet", "m-prefill": "StatefulSet",
    }  # fmt: skip
    lws = found["m-decode"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert spec["replicas"] == 2  # groups
    group = spec["leaderWorkerTemplate"]
    assert (group["size"], group["restartPolicy"]) == (4, "RecreateGroupOnPodRestart")
    assert "leaderTemplate" not in group  # every pod serves HTTP for its own ranks
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "partition": 0, "maxUnavailable": 1, "maxSurge": 0,
    }  # fmt: skip
    labels = group["workerTemplate"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "decode"


def test_each_pod_runs_its_share_of_the_ranks_with_vllms_multi_node_flags() -> None:
    vllm = container(workloads(model(WIDE))["m-decode"])
    args = vllm["args"]
    at = args.index("--nnodes")
    assert args[at : at + 9] == [
        "--nnodes", "4", "--node-rank", "$(LWS_WORKER_INDEX)", "--data-parallel-hybrid-lb",
        "--data-parallel-address", "$(LWS_LEADER_ADDRESS)", "--data-parallel-rpc-port", "29550",
    ]  # fmt: skip
    assert args[args.index("--data-parallel-size") + 1] == "16"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "4"  # TP 1 x 16 / 4 ranks per pod
    ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
    # NIXL listens at the base port + the global rank: one template, every rank's port.
    assert ports == {"http": 8000, "dp-rpc": 29550, "nixl": 5600,
                     **{f"nixl-dp{r}": 5600 + r for r in range(1, 16)}}  # fmt: skip
    assert "--enable-expert-parallel" not in args


def test_expert_parallelism_and_its_load_balancer_become_vllm_flags() -> None:
    expert = {"all2allBackend": "deepep_low_latency", "loadBalancer": {"numRedundantExperts": 32}}
    args = container(workloads(model({**WIDE, "expertParallel": expert}))["m-decode"])["args"]
    at = args.index("--enable-expert-parallel")
    assert args[at : at + 6] == [
        "--enable-expert-parallel", "--all2all-backend", "deepep_low_latency", "--enable-eplb",
        "--eplb-config", '{"num_redundant_experts":32}',
    ]  # fmt: skip


def test_a_group_stays_in_one_domain_whatever_the_slices_mode() -> None:
    domain = {"topologyKey": CLIQUE, "mode": "Preferred"}
    dm = model(WIDE, placement={"domain": domain})
    affinity = pod_template_of(workloads(dm)["m-decode"])["spec"]["affinity"]["podAffinity"]
    [group] = affinity["requiredDuringSchedulingIgnoredDuringExecution"]
    assert group == {
        "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "m",
                                          "app.kubernetes.io/component": "decode"}},
        "matchLabelKeys": [GROUP_KEY_LABEL],
        "topologyKey": CLIQUE,
    }  # fmt: skip
    prefill = pod_template_of(workloads(dm)["m-prefill"])["spec"]["affinity"]["podAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in prefill


def test_groups_are_held_by_the_rollout_partition_and_left_to_an_external_autoscaler() -> None:
    held = RolloutPlan(partitions={"m-decode": 1})
    lws = workloads(model(WIDE), rollout=held)["m-decode"]
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["partition"] == 1
    external = {**WIDE, "autoscaling": {"engine": "External", "minReplicas": 1}}
    assert "replicas" not in workloads(model(external))["m-decode"]["spec"]


def test_slices_make_one_leader_worker_set_each() -> None:
    placement = {"slices": 2, "domain": {"topologyKey": CLIQUE}}
    found = workloads(model({**WIDE, "replicas": 1}, placement=placement))
    assert sorted(n for n, o in found.items() if o["kind"] == "LeaderWorkerSet") == [
        "m-decode-s0", "m-decode-s1",
    ]  # fmt: skip


def group_terms(dm: DisaggregatedModel) -> list[dict[str, Any]]:
    affinity = pod_template_of(workloads(dm)["m-decode"])["spec"].get("affinity") or {}
    required = affinity.get("podAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    return [t for t in required or [] if t.get("matchLabelKeys") == [GROUP_KEY_LABEL]]


def test_on_gb200_a_group_stays_in_one_clique_without_a_domain_and_elsewhere_goes_anywhere() -> (
    None
):
    [term] = group_terms(model(WIDE, placement={"gpuProducts": ["NVIDIA-GB200"]}))
    assert term["topologyKey"] == CLIQUE  # GFD always publishes it on NVL72 trays
    assert group_terms(model(WIDE, placement={"gpuProducts": ["NVIDIA-H200"]})) == []
