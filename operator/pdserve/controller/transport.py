"""Transport preflight results: which node pairs each slice's probes pin to, the probe pods'
reports (their termination messages), the verdict per pair and the slice's, the worst of its
pairs. Pure functions."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.api.status import SliceTransport
from pdserve.builders.preflight import PROBE_REQUESTS, NodePair, job_name, wants_preflight
from pdserve.contract.names import COMPONENT_LABEL, KV_TRANSPORT_ANNOTATION, SLICE_LABEL, Component

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"  # the Job controller's, on its pods
JOB_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"


def _slice(pod: Mapping[str, Any]) -> int:
    return int(pod["metadata"].get("labels", {}).get(SLICE_LABEL, "0"))


def node_pairs(pods: Sequence[Mapping[str, Any]]) -> dict[int, list[NodePair]]:
    """Per slice, pairs that probe every node holding one of its engines, once its first
    prefill and first decode pod are bound: those two nodes, then each other prefill node with
    the first decode node and each other decode node with the first prefill node. A replica
    spanning nodes (or replicas spread over them) pulls KV over every node's NICs, and one bad
    rail shows on one node; P + D - 1 pairs find it, where all P x D would cost a probe each.
    A pair's slot comes from its pod's place in name order, so it holds while the pods do."""
    by_role: dict[tuple[int, str], list[Mapping[str, Any]]] = {}
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        role = pod["metadata"].get("labels", {}).get(COMPONENT_LABEL)
        if role in (Component.prefill.value, Component.decode.value):
            by_role.setdefault((_slice(pod), role), []).append(pod)
    pairs: dict[int, list[NodePair]] = {}
    for slice_index in sorted({key[0] for key in by_role}):
        prefill = [_node(p) for p in by_role.get((slice_index, Component.prefill.value), [])]
        decode = [_node(p) for p in by_role.get((slice_index, Component.decode.value), [])]
        if not prefill or not decode or prefill[0] is None or decode[0] is None:
            continue
        hub = NodePair(prefill[0], decode[0])
        found = [hub]
        seen = {(hub.prefill, "p"), (hub.decode, "d")}
        for offset, side, nodes in ((1, "p", prefill), (2, "d", decode)):
            for ordinal, node in enumerate(nodes):
                if node is None or (node, side) in seen:
                    continue
                seen.add((node, side))
                slot = 2 * ordinal + offset
                found.append(
                    NodePair(node, hub.decode, slot)
                    if side == "p"
                    else NodePair(hub.prefill, node, slot)
                )
        pairs[slice_index] = found
    return pairs


def _node(pod: Mapping[str, Any]) -> str | None:
    node = pod.get("spec", {}).get("nodeName")
    return str(node) if node else None


def report_of(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    """The probe's JSON report from a finished pod; a pod that died without one reports that."""
    status = pod.get("status", {})
    for container in status.get("containerStatuses", []):
        terminated = container.get("state", {}).get("terminated")
        if terminated is None:
            continue
        try:
            report = json.loads(terminated.get("message") or "")
        except json.JSONDecodeError:
            report = None
        if isinstance(report, dict):
            return report
        return {
            "ok": False,
            "error": f"probe container exited {terminated.get('exitCode')} "
            f"({terminated.get('reason', 'no reason')}) without a report",
        }
    if status.get("phase") == "Failed":
        return {"ok": False, "error": f"probe pod failed: {status.get('reason', 'unknown')}"}
    return None


def unschedulable(pod: Mapping[str, Any]) -> str | None:
    """`<pod>: <the scheduler's words>` for a pod the scheduler cannot place; None otherwise."""
    for condition in pod.get("status", {}).get("conditions", []):
        if (condition.get("type"), condition.get("status"), condition.get("reason")) == (
            "PodScheduled", "False", "Unschedulable",
        ):  # fmt: skip
            return f"{pod['metadata']['name']}: {condition.get('message') or 'Unschedulable'}"
    return None


def judge(
    dm: DisaggregatedModel,
    slice_index: int,
    pair: NodePair | None,
    reports: Sequence[dict[str, Any]],
    waiting: Sequence[str] = (),
) -> SliceTransport:
    """Whether the slice's KV path does what the spec asks: RDMA when placement.rdma is set
    (same-node pairs included: the NIC loops back between pods), intact data in any case."""
    if pair is None:
        return SliceTransport(
            slice=slice_index,
            reason="WaitingForPlacement",
            message="the slice's prefill and decode pods are not placed yet",
        )
    job = job_name(dm, slice_index, pair)
    base: dict[str, Any] = {"slice": slice_index, "nodes": pair.nodes, "job": job}
    failed = next((r for r in reports if not r.get("ok")), None)
    client = next((r for r in reports if r.get("role") == "client" and r.get("ok")), None)
    if waiting:
        # Not a finding about the KV path: the pair never ran together (its peer's timeout is
        # a consequence). The Job runs again once this is seen (probe_jobs_to_rerun).
        asks = " and ".join(f"{v} {k}" for k, v in PROBE_REQUESTS.items())
        peer = f" ({failed.get('role', 'probe')}: {failed.get('error')})" if failed else ""
        return SliceTransport(
            **base,
            reason="ProbeUnschedulable",
            message=f"probe pod {'; '.join(waiting)}{peer}. Each probe pod asks {asks} on "
            "the engines' nodes: free that on them, or set spec.kvTransfer.verify Off",
        )
    if failed is not None:
        error = failed.get("error") or "the probe failed"
        return SliceTransport(
            **base,
            verified=False,
            reason="ProbeFailed",
            message=f"{failed.get('role', 'probe')}: {error}",
        )
    if client is None or len(reports) < 2:
        return SliceTransport(
            **base, reason="Probing", message=f"waiting for the reports of Job {job}"
        )
    transport = str(client.get("transport") or "unknown")
    measured: dict[str, Any] = {
        "transport": transport,
        "read_path": [str(x) for x in client.get("readPath", [])],
        "bandwidth_g_bps": client.get("bandwidthGBps"),
        "latency_ms": client.get("latencyMs"),
    }
    numbers = (
        f"{transport} via {', '.join(measured['read_path']) or 'unknown lanes'}: "
        f"{client.get('bandwidthGBps')} GB/s, {client.get('latencyMs')} ms per "
        f"{int(client.get('bytes', 0)) // 2**20} MiB"
    )
    problems: list[tuple[str, str]] = []
    if client.get("dataIntact") is False:
        problems.append(("DataCorrupted", "the data read does not match what was written"))
    if dm.spec.placement.rdma is not None:
        for report in reports:
            devices = report.get("rdmaDevices") or []
            where = f"{report.get('role')} on {report.get('node')}"
            if not devices:
                problems.append(("NoRDMADevice", f"{where} sees no RDMA device"))
            elif not any(d.get("state") == "ACTIVE" for d in devices):
                states = ", ".join(
                    f"{d.get('device')}:{d.get('port')} {d.get('state')}" for d in devices
                )
                problems.append(("RDMALinkDown", f"{where}: no ACTIVE port ({states})"))
        # On one node the probe's host memory may take shared memory, which is no fallback;
        # TCP is one on any pair (the NIC loops back between pods on one node).
        if transport == "tcp" or (transport != "rdma" and len(pair.nodes) == 2):
            problems.append(
                (
                    "TCPFallback" if transport == "tcp" else "UnexpectedTransport",
                    f"placement.rdma is set but the data went over {transport}",
                )
            )
    if len(pair.nodes) == 1:
        # Separate pods are separate PID namespaces, which UCX's cuda_ipc refuses
        # (openucx/ucx#11978): whatever NVLink or P2P the node has, KV between them moves over
        # the lanes measured here, never CUDA IPC.
        numbers += (
            "; prefill and decode share a node but not a pod, so KV cannot use CUDA IPC "
            "(NVLink/P2P) between them"
        )
    if problems:
        reason = problems[0][0]
        message = "; ".join(m for _, m in problems) + f" ({numbers})"
        return SliceTransport(**base, **measured, verified=False, reason=reason, message=message)
    return SliceTransport(**base, **measured, verified=True, reason="Verified", message=numbers)


@dataclass(frozen=True)
class PairVerdict:
    """One node pair's probe verdict (pair None: the slice is not placed yet)."""

    pair: NodePair | None
    verdict: SliceTransport


def pair_verdicts(
    dm: DisaggregatedModel,
    engine_pods: Sequence[Mapping[str, Any]],
    probe_pods: Sequence[Mapping[str, Any]],
) -> list[list[PairVerdict]]:
    """Per slice (by index), the verdict of each of its node pairs' current Job."""
    if not wants_preflight(dm):
        return []
    pairs = node_pairs(engine_pods)
    verdicts: list[list[PairVerdict]] = []
    for slice_index in range(dm.spec.placement.slices):
        placed = pairs.get(slice_index)
        if not placed:
            verdicts.append([PairVerdict(None, judge(dm, slice_index, None, []))])
            continue
        judged = []
        for pair in placed:
            reports: list[dict[str, Any]] = []
            waiting: list[str] = []
            for pod in job_pods(probe_pods, job_name(dm, slice_index, pair)):
                report = report_of(pod)
                if report is not None:
                    reports.append(report)
                if (unplaced := unschedulable(pod)) is not None:
                    waiting.append(unplaced)
            judged.append(PairVerdict(pair, judge(dm, slice_index, pair, reports, waiting)))
        verdicts.append(judged)
    return verdicts


def slice_verdict(pairs: Sequence[PairVerdict]) -> SliceTransport:
    """The slice's verdict, the worst of its pairs': a failed pair (named, with how many
    failed), else one not concluded, else Verified with the slowest pair's numbers and every
    node probed. A slice of one pair reads as that pair's verdict."""
    if len(pairs) == 1:
        return pairs[0].verdict
    failed = [p for p in pairs if p.verdict.verified is False]
    pending = [p for p in pairs if p.verdict.verified is None]
    if failed:
        worst = failed[0]
        note = f" ({len(failed)} of {len(pairs)} node pairs failed)"
    elif pending:
        worst = pending[0]
        note = f" ({len(pairs) - len(pending)} of {len(pairs)} node pairs verified)"
    else:
        worst = min(pairs, key=lambda p: p.verdict.bandwidth_g_bps or 0.0)
        nodes = sorted({n for p in pairs if p.pair is not None for n in p.pair.nodes})
        return worst.verdict.model_copy(
            update={
                "nodes": nodes,
                "message": f"{len(pairs)} node pairs over {len(nodes)} nodes, the slowest "
                f"{worst.pair}: {worst.verdict.message}",
            }
        )
    return worst.verdict.model_copy(
        update={"message": f"{worst.pair}: {worst.verdict.message}{note}"}
    )


def slice_verdicts(
    dm: DisaggregatedModel,
    engine_pods: Sequence[Mapping[str, Any]],
    probe_pods: Sequence[Mapping[str, Any]],
) -> list[SliceTransport]:
    """One verdict per slice, from the probe pods of its node pairs' current Jobs."""
    return [slice_verdict(p) for p in pair_verdicts(dm, engine_pods, probe_pods)]


def job_pods(probe_pods: Sequence[Mapping[str, Any]], job: str) -> list[Mapping[str, Any]]:
    return [p for p in probe_pods if p["metadata"].get("labels", {}).get(JOB_NAME_LABEL) == job]


def probe_jobs_to_rerun(
    verdicts: Sequence[SliceTransport], probe_pods: Sequence[Mapping[str, Any]]
) -> list[str]:
    """Of the node pairs' verdicts (pair_verdicts, not the slices': a slice's names one Job),
    the Jobs whose probe can no longer conclude: one pod cannot be scheduled and the other has
    finished without it (its wait for the peer timed out). Deleted, they are made again by the
    next reconcile, and the pair probes once both run (a Job never retries: backoffLimit 0)."""
    return [
        verdict.job
        for verdict in verdicts
        if verdict.reason == "ProbeUnschedulable"
        and verdict.job is not None
        and any(report_of(pod) is not None for pod in job_pods(probe_pods, verdict.job))
    ]


def verified_condition(verdicts: Sequence[SliceTransport]) -> tuple[bool | None, str, str]:
    """TransportVerified over all slices: False names the first failing slice's reason."""
    if not verdicts:
        return None, "NotVerified", "spec.kvTransfer.verify is Off or the model is aggregated"
    bad = [v for v in verdicts if v.verified is False]
    if bad:
        return False, bad[0].reason, "; ".join(f"slice {v.slice}: {v.message}" for v in bad)
    pending = [v for v in verdicts if v.verified is None]
    if pending:
        return None, pending[0].reason, "; ".join(f"slice {v.slice}: {v.message}" for v in pending)
    return True, "Verified", "; ".join(f"slice {v.slice}: {v.message}" for v in verdicts)


def pod_annotation_patches(
    verdicts: Sequence[SliceTransport], engine_pods: Sequence[Mapping[str, Any]]
) -> list[tuple[str, str]]:
    """(pod name, value) for engine pods whose kv-transport annotation must change: Verified,
    Failed or Unverified, from their slice's verdict. The gateway reads it to keep P/D routing
    off unverified slices when kvTransfer.verify is Required."""
    by_slice = {v.slice: v for v in verdicts}
    patches = []
    for pod in engine_pods:
        verdict = by_slice.get(_slice(pod))
        if verdict is None or pod["metadata"].get("deletionTimestamp"):
            continue
        value = {True: "Verified", False: "Failed", None: "Unverified"}[verdict.verified]
        if pod["metadata"].get("annotations", {}).get(KV_TRANSPORT_ANNOTATION) != value:
            patches.append((pod["metadata"]["name"], value))
    return patches
