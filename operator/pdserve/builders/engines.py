"""Prefill and decode engine pools: a StatefulSet, its headless Service and a PDB each."""

from __future__ import annotations

from typing import Any

from pdserve.api import DisaggregatedModel, EnginePoolSpec
from pdserve.api.fit import hf_cache_gib
from pdserve.api.kv_transfer import NIXL_CONNECTORS
from pdserve.builders.adapters import adapter_mounts
from pdserve.builders.kv_compat import kv_compat_digest
from pdserve.builders.leaderworkerset import leader_worker_set
from pdserve.builders.names import child_name, engine_name, meta, selector_labels, slice_labels
from pdserve.builders.placement import (
    engine_affinity,
    engine_pod_annotations,
    engine_pod_fields,
    engine_resources,
    engine_security_context,
)
from pdserve.builders.pods import (
    common_env,
    env_list,
    http_probes,
    model_volumes,
    pdb,
    pod_annotations,
    pod_template,
)
from pdserve.builders.rollout import RolloutPlan
from pdserve.builders.scaling import ReplicaPlan, engine_replicas
from pdserve.builders.vllm_args import engine_args
from pdserve.contract.names import (
    DATA_PARALLEL_RPC_PORT,
    ENGINE_PORT,
    KV_COMPAT_ANNOTATION,
    MODEL_LABEL,
    Component,
)
from pdserve.contract.pod_layout import SHM_MOUNT

ROLES = {Component.prefill: "kv_producer", Component.decode: "kv_consumer"}
# After vLLM's --shutdown-timeout has run out (or the last request finished), the engine still
# has to stop its API server, engine core and GPU workers and free their memory: the kubelet's
# SIGKILL must not land in that (llm-d's P/D guide: 60 s drain within a 90 s grace period).
ENGINE_EXIT_MARGIN_SECONDS = 30


def termination_grace_seconds(pool: EnginePoolSpec) -> int:
    """The preStop drain, then vLLM's own drain of requests in flight, then its exit."""
    return pool.drain_seconds + pool.shutdown_timeout_seconds + ENGINE_EXIT_MARGIN_SECONDS


def nixl_env(dm: DisaggregatedModel) -> list[dict[str, Any]]:
    """NIXL finds its peer through the side channel on the pod IP (the default, localhost,
    only works when prefill and decode share a pod)."""
    kv = dm.spec.kv_transfer
    env: list[dict[str, Any]] = [
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST",
         "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(kv.side_channel_port)},
    ]  # fmt: skip
    if kv.ucx_net_devices:
        env.append({"name": "UCX_NET_DEVICES", "value": kv.ucx_net_devices})
    if kv.ucx_transports:
        env.append({"name": "UCX_TLS", "value": kv.ucx_transports})
    return env


def nixl_ports(base: int, data_parallel_size: int) -> list[dict[str, Any]]:
    """vLLM opens one NIXL side-channel listener per data-parallel rank, at base + rank: rank 0
    keeps the port name it always had."""
    return [
        {"name": "nixl" if rank == 0 else f"nixl-dp{rank}", "containerPort": base + rank,
         "protocol": "TCP"}
        for rank in range(data_parallel_size)
    ]  # fmt: skip


# /dev/shm per GPU of a pod: NCCL's shared-memory transport and vLLM's broadcast queues between
# workers use far less; the cap only keeps a leak from eating the pod's memory (a
# memory-medium emptyDir is charged to it) before the kubelet evicts the pod.
SHM_GIB_PER_GPU = 2


def shm_size(pool: EnginePoolSpec) -> str:
    """/dev/shm per pod: SHM_GIB_PER_GPU for each GPU (llm-d sizes it 2-20 Gi)."""
    return f"{SHM_GIB_PER_GPU * pool.gpus}Gi"


def with_disk(resources: dict[str, Any], cache_gib: int | None) -> dict[str, Any]:
    """`resources` plus an ephemeral-storage request for the weights' download, unless the
    pool's resources set one."""
    requests = resources.get("requests", {})
    if (
        cache_gib is None
        or "ephemeral-storage" in requests
        or "ephemeral-storage" in resources.get("limits", {})
    ):
        return resources
    return {**resources, "requests": {**requests, "ephemeral-storage": f"{cache_gib}Gi"}}


def engine_pool(
    dm: DisaggregatedModel,
    component: Component,
    pool: EnginePoolSpec,
    parity: str,
    plan: ReplicaPlan | None = None,
    rollout: RolloutPlan | None = None,
) -> list[dict[str, Any]]:
    """The objects of one engine pool: a StatefulSet per slice, one headless Service and one PDB.
    Roles: prefill produces KV, decode consumes it; without a prefill pool, decode serves
    aggregated (no KV transfer). `rollout`: the partitions holding StatefulSets mid engine
    upgrade (builders/rollout.py); None: none held."""
    service_name = child_name(dm, component)
    role = ROLES[component] if dm.spec.disaggregated else None
    kv = dm.spec.kv_transfer
    env = common_env(dm)
    ports: list[dict[str, Any]] = [
        {"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}
    ]
    if pool.multi_node:
        # Only the group's leader (rank 0's pod) listens; one template serves every pod.
        ports.append({"name": "dp-rpc", "containerPort": DATA_PARALLEL_RPC_PORT, "protocol": "TCP"})
    if role is not None and kv.connector in NIXL_CONNECTORS:
        env += nixl_env(dm)
        # Every global rank's port: the pod of group worker w listens on its own ranks' only.
        ports += nixl_ports(kv.side_channel_port, pool.data_parallel_size)
    env += env_list(pool.env)
    # Engines download the weights (render pods only the tokenizer): size the download and
    # ask the scheduler for a node with that much disk.
    cache_gib = None if dm.spec.placement.engines_on_cpu else hf_cache_gib(dm.spec)
    volumes, mounts = model_volumes(dm, cache_gib)
    adapters = adapter_mounts(dm, env)
    volumes, mounts = volumes + adapters.volumes, mounts + adapters.mounts
    if pool.gpus > 1:
        # NCCL between tensor/data-parallel workers needs more shared memory than 64Mi. Memory
        # backed: what it holds counts as the container's memory, so it is capped.
        volumes.append({"name": "dshm",
                        "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(pool)}})  # fmt: skip
        mounts.append({"name": "dshm", "mountPath": SHM_MOUNT})
    container: dict[str, Any] = {
        "name": "vllm",
        "image": dm.spec.image.engine,
        "imagePullPolicy": dm.spec.image.pull_policy,
        "command": ["vllm", "serve"],
        "args": engine_args(dm, pool, role, ENGINE_PORT),
        "env": env,
        "ports": ports,
        "resources": with_disk(engine_resources(dm, component, pool), cache_gib),
        **http_probes("/health", slow_start=True),
        "volumeMounts": mounts,
    }
    if pool.drain_seconds:
        # As render's: gateways drop a terminating pod at once (pod watch); the sleep covers the
        # watch's delay, so no request is sent to a closed listener (a prefill that fails so
        # falls back to decode's local prefill).
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": pool.drain_seconds}}}
    security = engine_security_context(dm)
    if security is not None:
        container["securityContext"] = security
    annotations = {**engine_pod_annotations(dm), **pool.pod_annotations}
    if role is not None:
        # Which decode pods can pull this pool's KV (and a new engine image rolls the pods).
        annotations[KV_COMPAT_ANNOTATION] = kv_compat_digest(dm, pool)
    objects: list[dict[str, Any]] = []
    group = selector_labels(dm, component) if pool.multi_node else None
    for slice_index in range(dm.spec.placement.slices):
        template = pod_template(
            dm,
            component,
            containers=[container],
            volumes=volumes,
            annotations=pod_annotations(parity, annotations),
            node_selector=pool.node_selector,
            tolerations=[dict(t) for t in pool.tolerations],
            # Let in-flight generations finish before the engine goes away.
            termination_grace_seconds=termination_grace_seconds(pool),
            gpu_pool=True,
            affinity=engine_affinity(dm, slice_index, group=group),
            extra_spec=engine_pod_fields(dm)
            | ({"initContainers": adapters.init_containers} if adapters.init_containers else {}),
            overrides=pool.pod_overrides,
        )
        selector = {**selector_labels(dm, component), **slice_labels(dm, slice_index)}
        selector.pop(MODEL_LABEL)  # selectors are immutable: keep the one models always had
        template["metadata"]["labels"].update(selector)
        spec: dict[str, Any] = {"serviceName": service_name}
        replicas = engine_replicas(dm, component, pool, slice_index, plan)
        if replicas is not None:  # None: an External autoscaler owns them
            spec["replicas"] = replicas
        name = engine_name(dm, component, slice_index)
        # Always written, 0 included: a partition released is then set back, not left behind.
        partition = rollout.partition(name) if rollout is not None else 0
        metadata = {**meta(dm, component, name), "labels": template["metadata"]["labels"]}
        if pool.multi_node:
            objects.append(leader_worker_set(metadata, pool, template, replicas, partition))
            continue
        strategy = {"type": "RollingUpdate", "rollingUpdate": {"partition": partition}}
        objects.append({
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": metadata,
            "spec": {
                **spec,
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": selector},
                "updateStrategy": strategy,
                "template": template,
            },
        })  # fmt: skip
    service_ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"],
                      "protocol": "TCP"} for p in ports]  # fmt: skip
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(dm, component),
        "spec": {
            "clusterIP": "None",
            # The gateway discovers engines itself and health-checks them; it wants to see pods
            # that are still starting too.
            "publishNotReadyAddresses": True,
            "selector": selector_labels(dm, component),
            "ports": service_ports,
        },
    }
    return [*objects, headless, pdb(dm, component, service_name)]
