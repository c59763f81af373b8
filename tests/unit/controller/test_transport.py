"""Transport preflight: the probe Job per slice, and the verdict from the probes' reports."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from pdserve.api import DisaggregatedModel, parse_resource
from pdserve.builders.preflight import PROBE_PORT, NodePair, job_name, preflight, probe_port
from pdserve.controller.transport import (
    node_pairs,
    pair_verdicts,
    pod_annotation_patches,
    probe_jobs_to_rerun,
    report_of,
    slice_verdicts,
    verified_condition,
)
from tests.support.specs import GPU_POOLS

# Two slices of 1 prefill + 1 decode over RDMA, verified before use.
BODY: dict[str, Any] = copy.deepcopy(GPU_POOLS)
BODY["spec"]["decode"]["replicas"] = 1
BODY["spec"]["kvTransfer"] = {"ucxTransports": "rc,cuda_copy", "verify": "Required"}
BODY["spec"]["placement"] = {
    "slices": 2,
    "domain": {"topologyKey": "nvidia.com/gpu.clique"},
    "rdma": {"resource": "rdma/rdma_shared_device_a", "networks": ["roce"]},
}
PAIRS = {0: NodePair("gpu-a", "gpu-b"), 1: NodePair("gpu-c", "gpu-c")}
PLACED = {i: [pair] for i, pair in PAIRS.items()}


def model(**spec: Any) -> DisaggregatedModel:
    body = copy.deepcopy(BODY)
    body["spec"].update(spec)
    return parse_resource(body)


def engine_pod(name: str, role: str, slice_index: int, node: str | None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app.kubernetes.io/component": role,
                                              "pdserve.io/slice": str(slice_index)}},
        "spec": {"nodeName": node} if node else {},
    }  # fmt: skip


def probe_pod(job: str, index: int, report: dict[str, Any] | str | None) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "metadata": {"name": f"{job}-{index}", "labels": {"batch.kubernetes.io/job-name": job}},
        "status": {"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]},
    }
    if report is not None:
        message = report if isinstance(report, str) else json.dumps(report)
        pod["status"] = {"phase": "Succeeded", "containerStatuses": [
            {"state": {"terminated": {"exitCode": 0, "reason": "Completed", "message": message}}}
        ]}  # fmt: skip
    return pod


RDMA_PORT = [{"device": "mlx5_0", "port": 1, "state": "ACTIVE", "linkLayer": "Ethernet"}]


def report(role: str, node: str, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "role": role, "node": node, "ok": True, "rdmaDevices": RDMA_PORT,
        "p2p": {"status": "OK"}, "transport": "rdma", "readPath": ["rc_mlx5/mlx5_0:1"],
        "bandwidthGBps": 23.4, "latencyMs": 2.9, "bytes": 64 * 2**20, "dataIntact": True,
    }  # fmt: skip
    return {**base, **over}


def test_one_probe_job_per_placed_slice_pinned_to_its_nodes() -> None:
    dm = model()
    objects = preflight(dm, PLACED)
    kinds = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert kinds[0] == ("ConfigMap", "m-kvprobe")
    jobs = [o for o in objects if o["kind"] == "Job"]
    assert [j["metadata"]["name"] for j in jobs] == [job_name(dm, 0, PAIRS[0]),
                                                     job_name(dm, 1, PAIRS[1])]  # fmt: skip
    assert all(len(j["metadata"]["name"]) <= 63 for j in jobs)
    spread, same_node = (j["spec"]["template"]["spec"] for j in jobs)
    hosts = spread["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert hosts["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["gpu-a", "gpu-b"]
    assert "podAntiAffinity" in spread["affinity"]  # one probe pod on each node
    assert "podAntiAffinity" not in same_node["affinity"]
    job = jobs[0]["spec"]
    assert (job["completionMode"], job["completions"], job["backoffLimit"]) == ("Indexed", 2, 0)
    container = spread["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    # The probe runs the engines' stack: their image, their UCX settings, their RDMA device.
    assert container["image"] == dm.spec.image.engine
    assert env["UCX_TLS"] == "rc,cuda_copy"
    assert env["PROBE_PEER"] == f"{jobs[0]['metadata']['name']}.ns.svc"
    assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    annotations = jobs[0]["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"k8s.v1.cni.cncf.io/networks": "roce"}


def test_probe_pods_claim_no_compute_domain_channel_the_engines_hold() -> None:
    """A ComputeDomain channel backs one claim per node (devtools/dra.py): a probe pod claiming
    the engines' channel beside them would stay Pending ("cannot allocate all claims", seen on
    the GB200 twin), and the probe uses no GPU."""
    claims = [{"name": "imex", "resourceClaimTemplateName": "nvl72-channel"}]
    dm = model(placement={**BODY["spec"]["placement"], "resourceClaims": claims})
    [job, *_] = [o for o in preflight(dm, PLACED) if o["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    assert "resourceClaims" not in pod
    assert "claims" not in pod["containers"][0]["resources"]


def test_no_probe_when_off_aggregated_or_unplaced() -> None:
    assert preflight(model(kvTransfer={"verify": "Off"}), PLACED) == []
    aggregated = model(prefill={**BODY["spec"]["prefill"], "replicas": 0})
    assert preflight(aggregated, PLACED) == []
    assert preflight(model(), {}) == []


def test_new_nodes_or_image_make_a_new_job() -> None:
    dm = model()
    assert job_name(dm, 0, PAIRS[0]) != job_name(dm, 0, NodePair("gpu-a", "gpu-z"))
    moved = model(image={"engine": "vllm/vllm-openai:other"})
    assert job_name(dm, 0, PAIRS[0]) != job_name(moved, 0, PAIRS[0])


def test_node_pairs_wait_until_prefill_and_decode_are_bound() -> None:
    pods = [engine_pod("m-prefill-s0-0", "prefill", 0, "gpu-a"),
            engine_pod("m-decode-s0-0", "decode", 0, "gpu-b"),
            engine_pod("m-prefill-s1-0", "prefill", 1, "gpu-c"),
            engine_pod("m-decode-s1-0", "decode", 1, None)]  # fmt: skip
    assert node_pairs(pods) == {0: [NodePair("gpu-a", "gpu-b")]}


def verdicts_for(dm: DisaggregatedModel, reports: dict[int, list[dict[str, Any]]]) -> list[Any]:
    engines = [engine_pod(f"m-{role}-s{i}-0", role, i, node) for i, pair in PAIRS.items()
               for role, node in (("prefill", pair.prefill), ("decode", pair.decode))]  # fmt: skip
    probes = [probe_pod(job_name(dm, i, PAIRS[i]), n, r)
              for i, rs in reports.items() for n, r in enumerate(rs)]  # fmt: skip
    return slice_verdicts(dm, engines, probes)


def test_rdma_path_is_verified_with_its_numbers() -> None:
    dm = model()
    good = [report("server", "gpu-a"), report("client", "gpu-b")]
    same = [report("server", "gpu-c"), report("client", "gpu-c", transport="shm")]
    first, second = verdicts_for(dm, {0: good, 1: same})
    assert (first.verified, first.reason, first.transport) == (True, "Verified", "rdma")
    assert first.message == "rdma via rc_mlx5/mlx5_0:1: 23.4 GB/s, 2.9 ms per 64 MiB"
    assert first.bandwidth_g_bps == 23.4
    assert first.nodes == ["gpu-a", "gpu-b"]
    assert second.verified is True  # one node: no NIC on the path
    assert verified_condition([first, second])[:2] == (True, "Verified")


@pytest.mark.parametrize(
    ("reports", "reason", "words"),
    [
        ([report("server", "gpu-a"), report("client", "gpu-b", transport="tcp",
                                            readPath=["tcp/eth0"], bandwidthGBps=1.1)],
         "TCPFallback", "placement.rdma is set but the data went over tcp"),
        ([report("server", "gpu-a", rdmaDevices=[]), report("client", "gpu-b")],
         "NoRDMADevice", "server on gpu-a sees no RDMA device"),
        ([report("server", "gpu-a"),
          report("client", "gpu-b", rdmaDevices=[{**RDMA_PORT[0], "state": "DOWN"}])],
         "RDMALinkDown", "client on gpu-b: no ACTIVE port (mlx5_0:1 DOWN)"),
        ([report("server", "gpu-a"), report("client", "gpu-b", dataIntact=False)],
         "DataCorrupted", "does not match"),
        ([report("server", "gpu-a"),
          {"role": "client", "ok": False, "error": "ModuleNotFoundError: No module named 'nixl'"}],
         "ProbeFailed", "client: ModuleNotFoundError"),
    ],
)  # fmt: skip
def test_failures_are_named(reports: list[dict[str, Any]], reason: str, words: str) -> None:
    [verdict, _] = verdicts_for(model(), {0: reports})
    assert (verdict.verified, verdict.reason) == (False, reason)
    assert words in verdict.message
    status, condition_reason, message = verified_condition([verdict])
    assert (status, condition_reason) == (False, reason)
    assert message.startswith("slice 0: ")


def same_node_verdict(dm: Any, client_transport: str) -> Any:
    reports = [report("server", "gpu-a", p2p={"status": "OK"}),
               report("client", "gpu-a", transport=client_transport)]  # fmt: skip
    engines = [engine_pod("m-prefill-0", "prefill", 0, "gpu-a"),
               engine_pod("m-decode-0", "decode", 0, "gpu-a")]  # fmt: skip
    job = job_name(dm, 0, NodePair("gpu-a", "gpu-a"))
    probes = [probe_pod(job, n, r) for n, r in enumerate(reports)]
    [verdict] = slice_verdicts(dm, engines, probes)
    return verdict


def test_same_node_pairs_never_claim_nvlink_between_pods() -> None:
    """A node whose GPUs all read peer-to-peer still gives two pods no CUDA IPC: the verdict
    names the lanes measured and says so."""
    # No RDMA device: tcp stays in the transports (spec.py, TRANSPORTS_NEED_TCP_OR_RDMA).
    dm = model(
        placement={"domain": {"topologyKey": "kubernetes.io/hostname"}},
        kvTransfer={"ucxTransports": "cuda_ipc,cuda_copy,tcp", "verify": "Required"},
    )
    verdict = same_node_verdict(dm, "tcp")
    assert (verdict.verified, verdict.reason) == (True, "Verified")
    assert verdict.message.startswith("tcp via ")
    assert verdict.message.endswith(
        "prefill and decode share a node but not a pod, so KV cannot use CUDA IPC "
        "(NVLink/P2P) between them"
    )


def test_rdma_on_one_node_is_still_rdma_or_a_tcp_fallback() -> None:
    dm = model(placement={"domain": {"topologyKey": "kubernetes.io/hostname"},
                          "rdma": {"resource": "rdma/rdma_shared_device_a"},
                          "guaranteedQoS": False})  # fmt: skip
    verdict = same_node_verdict(dm, "tcp")
    assert (verdict.verified, verdict.reason) == (False, "TCPFallback")


def test_pending_reports_and_bad_messages() -> None:
    dm = model()
    [waiting, unplaced] = verdicts_for(dm, {0: [report("server", "gpu-a"), None]})  # type: ignore[list-item]
    assert (waiting.verified, waiting.reason) == (None, "Probing")
    assert verified_condition([waiting, unplaced])[0] is None
    assert report_of(probe_pod("j", 0, "Traceback: boom")) == {
        "ok": False, "error": "probe container exited 0 (Completed) without a report",
    }  # fmt: skip


INSUFFICIENT_CPU = (
    "0/1 nodes are available: 1 Insufficient cpu. preemption: 0/1 nodes are available: "
    "1 No preemption victims found for incoming pod."
)


def unschedulable_pod(job: str, index: int) -> dict[str, Any]:
    """A probe pod the scheduler cannot place, as the API server shows it."""
    return {
        "metadata": {"name": f"{job}-{index}", "labels": {"batch.kubernetes.io/job-name": job}},
        "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": INSUFFICIENT_CPU},
        ]},
    }  # fmt: skip


def test_a_probe_pod_that_cannot_be_scheduled_is_no_transport_failure_and_runs_again() -> None:
    dm = model()
    job = job_name(dm, 0, PAIRS[0])
    engines = [engine_pod(f"m-{role}-s0-0", role, 0, node)
               for role, node in (("prefill", "gpu-a"), ("decode", "gpu-b"))]  # fmt: skip
    # The server runs, waiting for its peer: no verdict, and the scheduler's words.
    pending = [probe_pod(job, 0, None), unschedulable_pod(job, 1)]
    [verdict, _] = slice_verdicts(dm, engines, pending)
    assert (verdict.verified, verdict.reason) == (None, "ProbeUnschedulable")
    assert verdict.message == (
        f"probe pod {job}-1: {INSUFFICIENT_CPU}. Each probe pod asks 500m cpu and 1Gi memory "
        "on the engines' nodes: free that on them, or set spec.kvTransfer.verify Off"
    )
    assert verified_condition([verdict])[0] is None
    assert probe_jobs_to_rerun([verdict], pending) == []
    # The server gave up waiting: still no finding about the KV path, and the Job runs again.
    timed_out = {
        "role": "server",
        "ok": False,
        "error": "TimeoutError: timed out after 120s waiting for the client's metadata",
    }
    finished = [probe_pod(job, 0, timed_out), unschedulable_pod(job, 1)]
    [verdict, _] = slice_verdicts(dm, engines, finished)
    assert (verdict.verified, verdict.reason) == (None, "ProbeUnschedulable")
    assert "(server: TimeoutError: timed out after 120s" in verdict.message
    assert probe_jobs_to_rerun([verdict], finished) == [job]
    # Both placed and a real failure: a finding, not rerun.
    failed = [probe_pod(job, 0, timed_out), probe_pod(job, 1, None)]
    [verdict, _] = slice_verdicts(dm, engines, failed)
    assert (verdict.verified, verdict.reason) == (False, "ProbeFailed")
    assert probe_jobs_to_rerun([verdict], failed) == []


def test_engine_pods_get_their_slices_verdict_once() -> None:
    dm = model()
    good = [report("server", "gpu-a"), report("client", "gpu-b")]
    verdicts = verdicts_for(dm, {0: good})
    pods = [engine_pod("m-prefill-s0-0", "prefill", 0, "gpu-a"),
            engine_pod("m-decode-s1-0", "decode", 1, "gpu-c")]  # fmt: skip
    assert pod_annotation_patches(verdicts, pods) == [
        ("m-prefill-s0-0", "Verified"), ("m-decode-s1-0", "Unverified"),
    ]  # fmt: skip
    pods[0]["metadata"]["annotations"] = {"pdserve.io/kv-transport": "Verified"}
    assert pod_annotation_patches(verdicts, pods[:1]) == []


# A wide-EP slice: a prefill group over 2 trays and a decode group over 4 (LeaderWorkerSet
# names: the leader, then `<leader>-<worker>`).
GROUPS = [("m-prefill-0", "prefill", "tray-1"), ("m-prefill-0-1", "prefill", "tray-2"),
          ("m-decode-0", "decode", "tray-3"), ("m-decode-0-1", "decode", "tray-4"),
          ("m-decode-0-2", "decode", "tray-5"), ("m-decode-0-3", "decode", "tray-6")]  # fmt: skip


def test_every_node_of_a_slice_is_probed_with_the_first_pods_nodes() -> None:
    pods = [engine_pod(name, role, 0, node) for name, role, node in GROUPS]
    [pairs] = node_pairs(pods).values()
    assert [(p.prefill, p.decode) for p in pairs] == [
        ("tray-1", "tray-3"), ("tray-2", "tray-3"), ("tray-1", "tray-4"),
        ("tray-1", "tray-5"), ("tray-1", "tray-6"),
    ]  # fmt: skip
    assert {n for p in pairs for n in p.nodes} == {node for *_, node in GROUPS}
    # Replicas sharing a node share its probe.
    twice = [*pods, engine_pod("m-decode-1", "decode", 0, "tray-4")]
    assert node_pairs(twice)[0] == pairs
    # A pod bound later adds its pair; the others keep theirs (and their Jobs' names).
    late = [engine_pod(name, role, 0, None if name == "m-decode-0-1" else node)
            for name, role, node in GROUPS]  # fmt: skip
    [earlier] = node_pairs(late).values()
    assert earlier == [p for p in pairs if p.decode != "tray-4"]


def test_pairs_on_the_host_network_get_ports_of_their_own() -> None:
    """On the host network one node holds the probes of several pairs at once (the first
    pods' nodes, in every pair): each pair's server and client ports are its own."""
    rdma = {"resource": "rdma/rdma_shared_device_a", "hostNetwork": True}
    dm = model(placement={**BODY["spec"]["placement"], "slices": 1, "rdma": rdma})
    [pairs] = node_pairs([engine_pod(n, r, 0, node) for n, r, node in GROUPS]).values()
    jobs = [o for o in preflight(dm, {0: pairs}) if o["kind"] == "Job"]
    ports = []
    for job in jobs:
        env = {e["name"]: e.get("value") for e in
               job["spec"]["template"]["spec"]["containers"][0]["env"]}  # fmt: skip
        ports += [int(env["PROBE_PORT"]), int(env["PROBE_PORT"]) + 1]  # server, client
    assert len(set(ports)) == len(ports) == 10
    assert ports[0] == PROBE_PORT
    # In the pod network each probe pod has its own address: one port, and the first pair's
    # Job keeps the name it had before pairs had ports.
    plain = model(placement={**BODY["spec"]["placement"], "slices": 1})
    plain_jobs = [o for o in preflight(plain, {0: pairs}) if o["kind"] == "Job"]
    assert {probe_port(plain, p) for p in pairs} == {PROBE_PORT}
    assert plain_jobs[0]["metadata"]["name"] == job_name(plain, 0, NodePair("tray-1", "tray-3"))
    assert job_name(dm, 0, pairs[0]) == job_name(dm, 0, NodePair("tray-1", "tray-3"))


def group_verdicts(dm: DisaggregatedModel, failing: str | None = None, pending: str = "") -> Any:
    engines = [engine_pod(name, role, 0, node) for name, role, node in GROUPS]
    [pairs] = node_pairs(engines).values()
    probes = []
    for pair in pairs:
        job = job_name(dm, 0, pair)
        if pending in pair.nodes:
            probes.append(probe_pod(job, 0, None))
            continue
        broken = {"transport": "tcp", "readPath": ["tcp/eth0"]} if failing in pair.nodes else {}
        speed = {"bandwidthGBps": 19.5} if pair.decode == "tray-5" else {}
        client = report("client", pair.decode, **{**speed, **broken})
        probes += [probe_pod(job, 0, report("server", pair.prefill)), probe_pod(job, 1, client)]
    return pair_verdicts(dm, engines, probes), slice_verdicts(dm, engines, probes)


def test_a_slice_is_verified_only_when_every_pair_is_and_names_the_pair_that_is_not() -> None:
    dm = model(placement={**BODY["spec"]["placement"], "slices": 1})
    _, [verdict] = group_verdicts(dm)
    assert (verdict.verified, verdict.reason, verdict.bandwidth_g_bps) == (True, "Verified", 19.5)
    assert verdict.nodes == [f"tray-{i}" for i in range(1, 7)]
    assert verdict.message.startswith(
        "5 node pairs over 6 nodes, the slowest prefill node tray-1 -> decode node tray-5: "
        "rdma via rc_mlx5/mlx5_0:1: 19.5 GB/s"
    )
    # One tray's rail is down: its pair fails the slice, by name.
    _, [verdict] = group_verdicts(dm, failing="tray-6")
    assert (verdict.verified, verdict.reason, verdict.nodes) == (
        False, "TCPFallback", ["tray-1", "tray-6"],
    )  # fmt: skip
    assert verdict.message.startswith("prefill node tray-1 -> decode node tray-6: placement.rdma")
    assert verdict.message.endswith("(1 of 5 node pairs failed)")
    assert verified_condition([verdict])[:2] == (False, "TCPFallback")
    # A pair still probing: no verdict yet, and the pods keep Unverified.
    by_pair, [verdict] = group_verdicts(dm, pending="tray-2")
    assert (verdict.verified, verdict.reason) == (None, "Probing")
    assert verdict.message.endswith("(4 of 5 node pairs verified)")
    assert [p.verdict.verified for p in by_pair[0]] == [True, None, True, True, True]
    engines = [engine_pod(name, role, 0, node) for name, role, node in GROUPS]
    assert {v for _, v in pod_annotation_patches([verdict], engines)} == {"Unverified"}
