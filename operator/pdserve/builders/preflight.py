"""Transport preflight: per pair of a slice's prefill and decode nodes, a two-pod Job on those
nodes that moves data with NIXL from the engine image (pdserve/probe/kvprobe.py) and reports
what carried it. Pure: the nodes come from the pods the reconciler observed."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.api.kv_transfer import NIXL_CONNECTORS, TransportVerification
from pdserve.builders.engines import nixl_env
from pdserve.builders.names import labels, meta
from pdserve.builders.placement import (
    engine_pod_annotations,
    engine_security_context,
    host_network_fields,
)
from pdserve.contract.names import SLICE_LABEL, Component
from pdserve.contract.pod_layout import PROBE_MOUNT

PROBE_PORT = 5590  # not the engines' side-channel port: host-network probes share their nodes
HOSTNAME_LABEL = "kubernetes.io/hostname"


# Each of a slice's two probe pods, on the engines' nodes (the probe moves 64 MiB with NIXL).
PROBE_REQUESTS = {"cpu": "500m", "memory": "1Gi"}


def probe_script() -> str:
    return resources.files("pdserve.probe").joinpath("kvprobe.py").read_text()


@dataclass(frozen=True)
class NodePair:
    """A prefill node and a decode node of one slice, probed together."""

    prefill: str
    decode: str
    slot: int = 0
    """The pair's place among its slice's pairs, stable while its pods stay where they are:
    with host networking it picks the probe's ports, as one node may hold the probes of
    several pairs at once."""

    @property
    def nodes(self) -> list[str]:
        return sorted({self.prefill, self.decode})

    def __str__(self) -> str:
        return f"prefill node {self.prefill} -> decode node {self.decode}"


def probe_port(dm: DisaggregatedModel, pair: NodePair) -> int:
    """The probe server's port (its client listens on the next one). In the pod network each
    probe pod has an address of its own; on the host network the pairs of a node must not
    share ports."""
    rdma = dm.spec.placement.rdma
    if rdma is not None and rdma.host_network:
        return PROBE_PORT + 2 * pair.slot
    return PROBE_PORT


def wants_preflight(dm: DisaggregatedModel) -> bool:
    kv = dm.spec.kv_transfer
    return (
        dm.spec.disaggregated
        and kv.verify is not TransportVerification.off
        and kv.connector in NIXL_CONNECTORS
    )


def script_config_map_name(dm: DisaggregatedModel) -> str:
    return f"{dm.name}-kvprobe"


def job_name(dm: DisaggregatedModel, slice_index: int, pair: NodePair) -> str:
    """A new pair of nodes, port, engine image or UCX setting is a new Job (Job templates are
    immutable); the hash keeps the name within 63 characters."""
    kv = dm.spec.kv_transfer
    port = probe_port(dm, pair)
    identity = json.dumps(
        [pair.prefill, pair.decode, dm.spec.image.engine, kv.ucx_transports, kv.ucx_net_devices,
         dm.spec.placement.rdma.model_dump(mode="json") if dm.spec.placement.rdma else None,
         probe_script(),
         # Only where it moved, so the Jobs of pairs on the default port keep their names.
         *([port] if port != PROBE_PORT else [])],
    )  # fmt: skip
    digest = hashlib.sha256(identity.encode()).hexdigest()[:8]
    return f"{dm.name}-preflight-s{slice_index}-{digest}"


def preflight(
    dm: DisaggregatedModel, pairs: Mapping[int, Sequence[NodePair]]
) -> list[dict[str, Any]]:
    """The script ConfigMap and, per node pair of each placed slice, a headless Service (the
    client finds the server by DNS) and the probe Job."""
    if not wants_preflight(dm) or not pairs:
        return []
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(dm, Component.preflight, script_config_map_name(dm)),
        "data": {"kvprobe.py": probe_script()},
    }
    objects: list[dict[str, Any]] = [config_map]
    for slice_index, slice_pairs in sorted(pairs.items()):
        for pair in slice_pairs:
            name = job_name(dm, slice_index, pair)
            port = probe_port(dm, pair)
            objects += [_service(dm, name, port), _job(dm, slice_index, pair, name, port)]
    return objects


def _service(dm: DisaggregatedModel, name: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(dm, Component.preflight, name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {
                "batch.kubernetes.io/job-name": name,
                "batch.kubernetes.io/job-completion-index": "0",
            },
            "ports": [{"name": "nixl", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }  # fmt: skip


def _job(
    dm: DisaggregatedModel, slice_index: int, pair: NodePair, name: str, port: int
) -> dict[str, Any]:
    placement = dm.spec.placement
    pod_labels = {**labels(dm, Component.preflight), SLICE_LABEL: str(slice_index)}
    affinity: dict[str, Any] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [
                {"key": HOSTNAME_LABEL, "operator": "In", "values": pair.nodes},
            ]},
        ]}},
    }  # fmt: skip
    if len(pair.nodes) == 2:
        # One probe pod on each node: the transfer crosses the same link the KV will.
        affinity["podAntiAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {"batch.kubernetes.io/job-name": name}},
            "topologyKey": HOSTNAME_LABEL,
        }]}  # fmt: skip
    extended: dict[str, str] = {}
    if placement.rdma is not None:
        extended[placement.rdma.resource] = str(placement.rdma.count)
    container: dict[str, Any] = {
        "name": "probe",
        "image": dm.spec.image.engine,
        "imagePullPolicy": dm.spec.image.pull_policy,
        "command": ["python3", f"{PROBE_MOUNT}/kvprobe.py", "--role", "auto"],
        "env": [
            *[e for e in nixl_env(dm) if e["name"].startswith("UCX_")],
            {"name": "PROBE_PEER", "value": f"{name}.{dm.namespace}.svc"},
            {"name": "PROBE_PORT", "value": str(port)},
            # No GPU is allocated (the engines hold them), and none is asked for by
            # NVIDIA_VISIBLE_DEVICES=all: hardened NVIDIA runtimes ignore it in unprivileged
            # containers, and a pod that sees GPUs it did not request is what they forbid.
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        ],
        "ports": [{"name": "nixl", "containerPort": port, "protocol": "TCP"}],
        "resources": {
            "requests": dict(PROBE_REQUESTS),
            "limits": {"memory": "2Gi", **extended},
        },
        "volumeMounts": [{"name": "probe", "mountPath": PROBE_MOUNT, "readOnly": True}],
    }
    security = engine_security_context(dm)
    if security is not None:
        container["securityContext"] = security
    tolerations = [dict(t) for t in placement.tolerations]
    for pool in (dm.spec.prefill, dm.spec.decode):
        tolerations += [dict(t) for t in pool.tolerations] if pool is not None else []
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "affinity": affinity,
        "containers": [container],
        "volumes": [{"name": "probe", "configMap": {"name": script_config_map_name(dm)}}],
        # Not the engines' DRA claims (placement.resourceClaims): the probe uses no GPU, and a
        # ComputeDomain channel backs one claim per node, which the engine there holds, so a
        # probe pod claiming one would never be scheduled beside it.
        **host_network_fields(dm),
    }
    if tolerations:
        spec["tolerations"] = tolerations
    if dm.spec.image.pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in dm.spec.image.pull_secrets]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {**meta(dm, Component.preflight, name), "labels": pod_labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": 2,
            "parallelism": 2,
            # A failed probe is a finding, not something to retry.
            "backoffLimit": 0,
            "activeDeadlineSeconds": 600,
            "template": {
                "metadata": {"labels": pod_labels, "annotations": engine_pod_annotations(dm)},
                "spec": spec,
            },
        },
    }


__all__ = ["NodePair", "job_name", "preflight", "probe_port", "wants_preflight"]
