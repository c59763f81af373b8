"""Every example on every GPU profile it may land on, in namespaces that enforce each Pod Security
level, on the real API server (its built-in PodSecurity admission), the real scheduler and kwok
twins of real GPU nodes (devtools.nodes), with the operator and its validating webhook running.

Each case ends in exactly one of two ways: refused at apply time by the webhook, with a message
that names the field (or the namespace label) and the fix, or every pod of every pool bound by
the scheduler onto nodes of that profile, with the wiring right (ports, NIXL/UCX env, GPUs, RDMA
device and IPC_LOCK only with placement.rdma, every DRA claim of placement.resourceClaims
allocated by the scheduler on a device of the pod's own node). Anything else (a pod Pending past
the wait, a StatefulSet's FailedCreate) fails, with the scheduler's or the API server's words.

NVIDIA's DRA driver for GPUs is twinned on the GB200 trays (devtools/dra.py): its ComputeDomain
DeviceClasses and each tray's compute-domain ResourceSlice exist for the module, and the
ResourceClaimTemplate its ComputeDomain controller would create for the example's ComputeDomain
exists in the case's namespace while the case runs. Each tray publishes one channel device, so
each engine pod holding a channel claim has a tray to itself.

An example that names no GPU product is restricted to the profile by adding
placement.gpuProducts (which also subjects it to the memory-fit check, api/fit.py); the
simulator example, whose engines request no GPU, is kept on the CPU nodes by a required node
affinity (nvidia.com/gpu.present DoesNotExist). The outcomes are written to docs/cluster-fit.md;
PDSERVE_UPDATE_TABLE=1 regenerates it, and otherwise a difference fails.

A second set of tests holds pdserve's own Pod Security judgement (builders/pod_security.py) to the
API server's: every pod template pdserve builds for each example is created as a Pod with
dryRun=All in each namespace, and the checks the API server names must be the ones pdserve
names; the gateway's and render's are admitted at every level, restricted included."""

from __future__ import annotations

import copy
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from devtools import dra
from devtools.localplane import ControlPlane, ControlPlaneError, wait_until
from devtools.lws import LwsManager
from devtools.model_volume import CLAIM_NAME
from devtools.nodes import (
    CLIQUE_0,
    CLIQUE_1,
    GB200_FABRIC,
    FakeNode,
    create_nodes,
    gb200_nvl72_node,
    hgx_h100_node,
    hgx_h200_node,
    l40s_node,
    wait_nodes_ready,
)
from devtools.operator_proc import RunningOperator
from devtools.resources import APPLY, dm_url, get
from pdserve.api import DisaggregatedModel, EnginePoolSpec, parse_resource
from pdserve.api.gpu_products import GB200, H100_80GB_HBM3, H200, L40S, PRODUCT_LABEL
from pdserve.api.kv_transfer import NIXL_CONNECTORS
from pdserve.api.placement import Strength
from pdserve.builders import build_all
from pdserve.builders.leaderworkerset import API_VERSION as LWS_API_VERSION
from pdserve.builders.leaderworkerset import GROUP_KEY_LABEL as LWS_GROUP_KEY_LABEL
from pdserve.builders.leaderworkerset import NAME_LABEL as LWS_NAME_LABEL
from pdserve.builders.leaderworkerset import WORKER_INDEX_LABEL as LWS_WORKER_INDEX_LABEL
from pdserve.builders.leaderworkerset import pod_template_of
from pdserve.builders.pod_security import (
    ENFORCE_LABEL,
    WORKLOAD_KINDS,
    PodSecurityLevel,
    pod_violations,
)
from pdserve.builders.preflight import NodePair, preflight
from pdserve.contract.names import COMPONENT_LABEL, DATA_PARALLEL_RPC_PORT

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("dm_crd")]

RESYNC_SECONDS = 30  # every case is judged on the operator's first pass; resyncs only cost CPU
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))  # examples/gitops is kustomize: skipped
TABLE = ROOT / "docs" / "cluster-fit.md"
UPDATE = os.environ.get("PDSERVE_UPDATE_TABLE") == "1"
BIND_SECONDS = 60.0
APPLY_SECONDS = 45.0  # the webhook may take the API server's 30 s when the operator is busy
LANES_AT_ONCE = 6
GONE_SECONDS = 60.0
INSTANCE_LABEL = "app.kubernetes.io/instance"
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"
GPU = "nvidia.com/gpu"
LEVELS = tuple(PodSecurityLevel)
WORKLOADS = {"StatefulSet": "/apis/apps/v1", "Deployment": "/apis/apps/v1",
             "LeaderWorkerSet": f"/apis/{LWS_API_VERSION}"}  # fmt: skip
ENGINES = ("prefill", "decode")
CPU_POOLS = ("render", "gateway")
PLURAL = {"StatefulSet": "statefulsets", "Deployment": "deployments", "Job": "jobs",
          "LeaderWorkerSet": "leaderworkersets"}  # fmt: skip


@dataclass(frozen=True)
class Profile:
    name: str
    key: str  # in namespace names
    product: str | None  # nvidia.com/gpu.product; None: CPU nodes


H200_HGX = Profile("HGX H200", "h200", H200.product)
H100_HGX = Profile("HGX H100", "h100", H100_80GB_HBM3.product)
GB200_NVL72 = Profile("GB200 NVL72", "gb200", GB200.product)
L40S_PCIE = Profile("L40S", "l40s", L40S.product)
CPU = Profile("CPU", "cpu", None)
GPU_PROFILES = (H200_HGX, H100_HGX, GB200_NVL72, L40S_PCIE)
PROFILES = (*GPU_PROFILES, CPU)

CLIQUE_2 = f"{GB200_FABRIC}.2"
# Trays per GB200 clique in this module (a real NVL72 rack is one clique of 18 trays). A pod
# holding a ComputeDomain channel claim takes its tray's only channel device (devtools/dra.py),
# so a slice of 3 such engine pods needs 3 trays of one clique; 6 hold both slices of the
# gb200-nvl72-slices example even where the scheduler puts them in one clique.
TRAYS_PER_CLIQUE = 6
DEMO_TRAYS = 2  # the session's demo nodes: gb200-c0-{0,1} and gb200-c1-{0,1}
# Added to the session's demo nodes (2 HGX H200, two GB200 NVL72 cliques of 2 trays, 1 L40S,
# 2 CPU) for this module and removed after it: 6 HGX H200 (48 GPUs: the RDMA example's two
# 6-GPU slices next to another case), 4 HGX H100, trays that grow the two demo cliques to
# TRAYS_PER_CLIQUE and a third clique of as many, 4 L40S servers (16 GPUs), 6 CPU nodes for the
# render and gateway pods.
FIT_NODES: tuple[FakeNode, ...] = (
    *(hgx_h200_node(f"fit-h200-{i}") for i in range(4)),
    *(hgx_h100_node(f"fit-h100-{i}") for i in range(4)),
    *(
        gb200_nvl72_node(f"fit-gb200-c{c}-{i}", clique=clique)
        for c, clique in enumerate((CLIQUE_0, CLIQUE_1))
        for i in range(DEMO_TRAYS, TRAYS_PER_CLIQUE)
    ),
    *(gb200_nvl72_node(f"fit-gb200-c2-{i}", clique=CLIQUE_2) for i in range(TRAYS_PER_CLIQUE)),
    *(l40s_node(f"fit-l40s-{i}") for i in range(3)),
    *(
        FakeNode(name=f"fit-cpu-{i}", cpu="16", memory="64Gi", ephemeral_storage="200Gi")
        for i in range(4)
    ),
)
assert CLIQUE_0 != CLIQUE_2

# What the examples reference and a cluster must hold before they are applied.
PV_SIZE = "2Ti"
MODEL_CLAIMS = {
    "model-store": "ReadOnlyMany",
    CLAIM_NAME: "ReadOnlyMany",
    "hf-cache": "ReadWriteMany",
    "lora-adapters": "ReadOnlyMany",
}
"""The examples' spec.model.source.pvc.claimName, source.hf.cache.claimName and adapters'
pvc.claimName, by access mode."""


def _example(path: Path) -> dict[str, Any]:
    [body] = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert isinstance(body, dict)
    return body


def _parsed(body: Mapping[str, Any], namespace: str) -> DisaggregatedModel:
    body = copy.deepcopy(dict(body))
    body["metadata"]["namespace"] = namespace
    return parse_resource(body)


def profiles_of(body: Mapping[str, Any]) -> list[Profile]:
    """The profiles an example may land on: its gpuProducts / nodeSelector, every GPU profile
    when it names none, the CPU nodes when its engines request no accelerator."""
    placement = _parsed(body, "x").spec.placement
    if placement.engines_on_cpu:
        return [CPU]
    named = placement.products
    return [p for p in GPU_PROFILES if not named or p.product in named]


@dataclass(frozen=True)
class Case:
    example: str
    profile: Profile
    level: PodSecurityLevel

    @property
    def id(self) -> str:
        return f"{self.example}-{self.profile.key}-{self.level.value}"

    @property
    def namespace(self) -> str:
        return f"fit-{self.profile.key}-{self.level.value}"


BODIES = {path.stem: _example(path) for path in EXAMPLES}


def channel_templates(body: Mapping[str, Any]) -> list[str]:
    """The ResourceClaimTemplates an example's engine pods claim from. The one example with
    claims claims the IMEX channel of a ComputeDomain (gb200-nvl72-slices), so the twin reads
    each as a ComputeDomain's channel template, which NVIDIA's ComputeDomain controller
    creates when the user creates the ComputeDomain (devtools/dra.py)."""
    claims = _parsed(body, "x").spec.placement.resource_claims
    return [c.resource_claim_template_name for c in claims if c.resource_claim_template_name]


# Every channel claim takes its tray's only channel device, and trays are shared by the lanes:
# cases whose pods claim channels run one at a time, each finding every tray's channel free.
CHANNEL_CASES = threading.Lock()
CASES = [
    Case(stem, profile, level)
    for stem, body in BODIES.items()
    for profile in profiles_of(body)
    for level in LEVELS
]


def restricted_to(body: Mapping[str, Any], profile: Profile, namespace: str) -> dict[str, Any]:
    """The example as applied: into `namespace`, and onto `profile` where it names none."""
    applied = copy.deepcopy(dict(body))
    applied["metadata"]["namespace"] = namespace
    placement = applied["spec"].setdefault("placement", {})
    if profile.product is None:
        cpu_only = {"matchExpressions": [{"key": GPU_PRESENT_LABEL, "operator": "DoesNotExist"}]}
        required = {"nodeSelectorTerms": [cpu_only]}
        placement["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}
        }
    elif not _parsed(body, namespace).spec.placement.products:
        placement["gpuProducts"] = [profile.product]
    return applied


@dataclass
class Outcome:
    case: Case
    result: str = ""  # "bound" or "refused"
    detail: str = ""  # bound: where; refused: the message's first clause
    transport: str = ""
    message: str = ""
    problems: list[str] = field(default_factory=list)  # anything a user should not see
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds since the start


# ---- prerequisites ---------------------------------------------------------------------------


def _create(http: httpx.Client, path: str, body: Mapping[str, Any]) -> None:
    response = http.post(path, json=body)
    assert response.is_success or response.status_code == 409, response.text


def prerequisites(http: httpx.Client, namespace: str) -> None:
    """What the examples reference: the model PVCs (each bound to a PV of its own), the
    chat-template ConfigMap, the registry pull secret and the Hugging Face token."""
    ns = f"/api/v1/namespaces/{namespace}"
    for claim, mode in MODEL_CLAIMS.items():
        pv_name = f"{namespace}-{claim}"
        _create(http, "/api/v1/persistentvolumes", {
            "metadata": {"name": pv_name},
            "spec": {"capacity": {"storage": PV_SIZE}, "accessModes": [mode],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                     "nfs": {"server": "192.0.2.10", "path": f"/models/{claim}"},
                     "claimRef": {"namespace": namespace, "name": claim}},
        })  # fmt: skip
        _create(http, f"{ns}/persistentvolumeclaims", {
            "metadata": {"name": claim},
            "spec": {"accessModes": [mode], "storageClassName": "",
                     "volumeName": pv_name, "resources": {"requests": {"storage": PV_SIZE}}},
        })  # fmt: skip
    _create(
        http,
        f"{ns}/configmaps",
        {
            "metadata": {"name": "qwq-chat-template"},
            "data": {"template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}"},
        },
    )
    docker_config = json.dumps({"auths": {"registry.example": {"auth": "dTpw"}}})
    _create(http, f"{ns}/secrets", {
        "metadata": {"name": "registry-creds"}, "type": "kubernetes.io/dockerconfigjson",
        "stringData": {".dockerconfigjson": docker_config},
    })  # fmt: skip
    _create(http, f"{ns}/secrets", {"metadata": {"name": "hf-token"},
                                     "stringData": {"token": "hf_test"}})  # fmt: skip


def pvc_bound(http: httpx.Client, namespace: str) -> bool:
    def bound(claim: str) -> bool:
        pvc = get(http, f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{claim}")
        phase: str | None = (pvc or {}).get("status", {}).get("phase")
        return phase == "Bound"

    return all(bound(claim) for claim in MODEL_CLAIMS)


def create_namespace(http: httpx.Client, name: str, level: PodSecurityLevel) -> None:
    body = {"metadata": {"name": name, "labels": {ENFORCE_LABEL: level.value}}}
    _create(http, "/api/v1/namespaces", body)
    wait_until(
        f"the default ServiceAccount in {name}",
        lambda: http.get(f"/api/v1/namespaces/{name}/serviceaccounts/default").is_success,
        timeout=30,
    )


def delete_namespace(http: httpx.Client, name: str) -> None:
    http.delete(f"/api/v1/namespaces/{name}")
    for claim in MODEL_CLAIMS:
        http.delete(f"/api/v1/persistentvolumes/{name}-{claim}")


# ---- one case --------------------------------------------------------------------------------


def split_top(text: str, separator: str) -> list[str]:
    """`text` split at `separator` outside parentheses."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        char = text[i]
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and text.startswith(separator, i):
            parts.append(text[start:i])
            i += len(separator)
            start = i
            continue
        i += 1
    parts.append(text[start:])
    return parts


WEBHOOK_PREFIX = re.compile(r'^admission webhook "[^"]+" denied the request: ')


def first_clause(message: str, namespace: str) -> str:
    """The refusal's first clause (long parentheses elided) and its fix, the namespace's own
    name generalised: what the table shows."""
    text = WEBHOOK_PREFIX.sub("", message).replace(namespace, "<ns>")
    text, _, fix = text.partition(" Fix: ")
    clause = ""
    for part in split_top(text, ": "):
        clause = f"{clause}: {part}" if clause else part
        if len(clause) >= 40:
            break
    clause = re.sub(r"\([^()]{80,}\)", "(...)", clause.rstrip("."))
    return f"{clause}. Fix: {fix.split('; ')[0]}" if fix else clause


def refusal_problems(message: str) -> list[str]:
    problems = []
    if not ("spec." in message or ENFORCE_LABEL in message):
        problems.append(f"the refusal names no spec field (nor the namespace label): {message}")
    if "Fix:" not in message and "fix" not in message.lower():
        problems.append(f"the refusal names no fix: {message}")
    return problems


def workloads_of(dm: DisaggregatedModel) -> list[dict[str, Any]]:
    return [o for o in build_all(dm) if o["kind"] in WORKLOADS]


def pods_of(http: httpx.Client, namespace: str, selector: Mapping[str, str]) -> list[Any]:
    labels = ",".join(f"{k}={v}" for k, v in selector.items())
    response = http.get(f"/api/v1/namespaces/{namespace}/pods", params={"labelSelector": labels})
    response.raise_for_status()
    return [p for p in response.json()["items"] if not p["metadata"].get("deletionTimestamp")]


def all_bound(http: httpx.Client, dm: DisaggregatedModel) -> bool:
    """Every workload pdserve builds exists and has exactly its replicas, all bound to a node;
    a render pool under an HPA has reached the HPA's minReplicas first (the HPAs pdserve builds,
    not those already live: before the operator creates one, the pool runs 1 replica)."""
    ns = dm.namespace
    floor = {h["spec"]["scaleTargetRef"]["name"]: h["spec"].get("minReplicas", 1)
             for h in build_all(dm) if h["kind"] == "HorizontalPodAutoscaler"}  # fmt: skip
    for built in workloads_of(dm):
        kind, name = built["kind"], built["metadata"]["name"]
        live = get(http, f"{WORKLOADS[kind]}/namespaces/{ns}/{PLURAL[kind]}/{name}")
        if live is None:
            return False
        replicas = live["spec"].get("replicas", 1)
        if replicas < floor.get(name, 0):
            return False
        if kind == "LeaderWorkerSet":  # groups of `size` pods, selected by LWS's own label
            replicas *= live["spec"]["leaderWorkerTemplate"]["size"]
            pods = pods_of(http, ns, {LWS_NAME_LABEL: name})
        else:
            pods = pods_of(http, ns, live["spec"]["selector"]["matchLabels"])
        if len(pods) != replicas or not all(p["spec"].get("nodeName") for p in pods):
            return False
    return True


def why_not_bound(http: httpx.Client, dm: DisaggregatedModel) -> str:
    """The scheduler's and the API server's words: unscheduled pods' PodScheduled messages and
    the namespace's warning events (FailedCreate, FailedScheduling)."""
    words = []
    for pod in pods_of(http, dm.namespace, {INSTANCE_LABEL: dm.name}):
        if pod["spec"].get("nodeName"):
            continue
        for condition in pod.get("status", {}).get("conditions", []):
            if condition["type"] == "PodScheduled" and condition["status"] == "False":
                words.append(f"pod {pod['metadata']['name']}: {condition.get('message')}")
    events = http.get(f"/api/v1/namespaces/{dm.namespace}/events").json()["items"]
    for event in events:
        if event.get("type") == "Warning":
            involved = event["involvedObject"]
            words.append(f"{involved['kind']} {involved['name']} {event['reason']}: "
                         f"{event['message']}")  # fmt: skip
    dm_body = get(http, dm_url(dm.namespace, dm.name)) or {}
    for condition in dm_body.get("status", {}).get("conditions", []):
        if condition["status"] == "False" and condition["type"] in ("Placement", "Ready"):
            words.append(f"condition {condition['type']}=False {condition.get('reason')}: "
                         f"{condition.get('message')}")  # fmt: skip
    return "; ".join(words) or "no pod, event or condition says why"


def transport_of(dm: DisaggregatedModel) -> str:
    spec = dm.spec
    kv, rdma = spec.kv_transfer, spec.placement.rdma
    if not spec.disaggregated:
        return "none (aggregated: no KV transfer)"
    if spec.placement.engines_on_cpu and "/pdserve-sim:" in spec.image.engine:
        return "simulator (KV over HTTP)"
    if spec.placement.engines_on_cpu:
        return "NIXL over TCP between CPU engine pods (vLLM's CPU build)"
    if kv.connector not in NIXL_CONNECTORS:
        return kv.connector.value
    if rdma is None:
        return "NIXL over TCP on the pod network (no placement.rdma: no RDMA device requested)"
    networks = (
        f"; Multus networks {', '.join(rdma.networks)}: annotation only, the plane has no Multus"
        if rdma.networks
        else ""
    )
    return (
        f"NIXL over RDMA: {rdma.resource} x{rdma.count}, IPC_LOCK, "
        f"UCX_TLS={kv.ucx_transports}{networks}"
    )


def env_of(container: Mapping[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def wiring_problems(pod: Mapping[str, Any], dm: DisaggregatedModel) -> list[str]:
    """The engine container as a user would inspect it on the bound pod."""
    name = pod["metadata"]["name"]
    spec, placement, kv = dm.spec, dm.spec.placement, dm.spec.kv_transfer
    component = pod["metadata"]["labels"][COMPONENT_LABEL]
    pool = spec.prefill if component == "prefill" else spec.decode
    assert pool is not None
    [vllm] = [c for c in pod["spec"]["containers"] if c["name"] == "vllm"]
    problems = []
    ports = {p["name"]: p["containerPort"] for p in vllm.get("ports", [])}
    env = env_of(vllm)
    wanted_ports = {"http": 8000}
    if pool.multi_node:
        wanted_ports["dp-rpc"] = DATA_PARALLEL_RPC_PORT
        problems += group_wiring_problems(pod, vllm, pool)
    if spec.disaggregated and kv.connector in NIXL_CONNECTORS:
        # One listener per data-parallel rank (global ranks: every pod of a group declares all).
        for rank in range(pool.data_parallel_size):
            wanted_ports["nixl" if rank == 0 else f"nixl-dp{rank}"] = kv.side_channel_port + rank
        wanted_env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": {"fieldRef": {"apiVersion": "v1",
                                                         "fieldPath": "status.podIP"}},
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(kv.side_channel_port),
        }  # fmt: skip
        if kv.ucx_transports:
            wanted_env["UCX_TLS"] = kv.ucx_transports
        if kv.ucx_net_devices:
            wanted_env["UCX_NET_DEVICES"] = kv.ucx_net_devices
        got = {k: v for k, v in env.items() if k.startswith(("UCX_", "VLLM_NIXL_"))}
        if got != wanted_env:
            problems.append(f"{name}: NIXL/UCX env {got}, expected {wanted_env}")
    if ports != wanted_ports:
        problems.append(f"{name}: ports {ports}, expected {wanted_ports}")
    limits = vllm.get("resources", {}).get("limits", {})
    gpus = limits.get(placement.accelerator_resource) if placement.accelerator_resource else None
    wanted_gpus = str(pool.gpus) if placement.accelerator_resource else None
    if gpus != wanted_gpus:
        problems.append(f"{name}: {placement.accelerator_resource or GPU} {gpus}, "
                        f"expected {wanted_gpus}")  # fmt: skip
    rdma_limits = {k: v for k, v in limits.items() if k.startswith("rdma/")}
    wanted_rdma = {placement.rdma.resource: str(placement.rdma.count)} if placement.rdma else {}
    if rdma_limits != wanted_rdma:
        problems.append(f"{name}: RDMA resources {rdma_limits}, expected {wanted_rdma}")
    added = (vllm.get("securityContext") or {}).get("capabilities", {}).get("add", [])
    if ("IPC_LOCK" in added) != (placement.rdma is not None):
        problems.append(f"{name}: capabilities.add {added} with placement.rdma "
                        f"{'set' if placement.rdma else 'unset'}")  # fmt: skip
    if placement.rdma is not None and (not kv.ucx_transports or "tcp" in kv.ucx_transports):
        problems.append(f"{name}: RDMA requested but UCX_TLS={kv.ucx_transports!r} lets UCX "
                        "fall back to TCP silently")  # fmt: skip
    return problems


def group_wiring_problems(
    pod: Mapping[str, Any], vllm: Mapping[str, Any], pool: EnginePoolSpec
) -> list[str]:
    """A pod of a LeaderWorkerSet group: LWS's webhook gave it its group's env and labels, and
    its vLLM line takes its node rank and the leader's address from them."""
    name, labels = pod["metadata"]["name"], pod["metadata"]["labels"]
    env = env_of(vllm)
    worker = labels.get(LWS_WORKER_INDEX_LABEL)
    wanted = {"LWS_GROUP_SIZE": str(pool.nodes_per_replica), "LWS_WORKER_INDEX": worker}
    got = {k: env.get(k) for k in wanted}
    problems = [] if got == wanted else [f"{name}: LWS env {got}, expected {wanted}"]
    if not str(env.get("LWS_LEADER_ADDRESS", "")).startswith(f"{labels.get(LWS_NAME_LABEL)}-"):
        problems.append(f"{name}: LWS_LEADER_ADDRESS {env.get('LWS_LEADER_ADDRESS')!r}")
    args = vllm["args"]
    flags = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    if (flags.get("--node-rank"), flags.get("--nnodes")) != (
        "$(LWS_WORKER_INDEX)",
        str(pool.nodes_per_replica),
    ):
        problems.append(f"{name}: --nnodes {flags.get('--nnodes')} --node-rank "
                        f"{flags.get('--node-rank')}")  # fmt: skip
    return problems


def cpu_pod_problems(pod: Mapping[str, Any]) -> list[str]:
    """Render and gateway pods hold no GPU, no RDMA device and no added capability."""
    problems = []
    for container in pod["spec"]["containers"]:
        limits = container.get("resources", {}).get("limits", {})
        held = sorted(k for k in limits if k == GPU or k.startswith("rdma/"))
        added = (container.get("securityContext") or {}).get("capabilities", {}).get("add")
        if held or added:
            problems.append(f"{pod['metadata']['name']}: CPU pod holds {held}, adds {added}")
    if pod["spec"].get("resourceClaims"):
        problems.append(f"{pod['metadata']['name']}: CPU pod claims "
                        f"{pod['spec']['resourceClaims']}")  # fmt: skip
    return problems


def slice_devices(http: httpx.Client) -> dict[tuple[str, str], tuple[str, set[str]]]:
    """Every published ResourceSlice's devices: (driver, pool) -> (node, device names)."""
    response = http.get(f"{dra.RESOURCE_PATH}/resourceslices")
    response.raise_for_status()
    out: dict[tuple[str, str], tuple[str, set[str]]] = {}
    for item in response.json()["items"]:
        spec = item["spec"]
        key = (spec["driver"], spec["pool"]["name"])
        out.setdefault(key, (spec.get("nodeName", ""), set()))[1].update(
            d["name"] for d in spec.get("devices", [])
        )
    return out


def claim_problems(
    http: httpx.Client, pod: Mapping[str, Any], dm: DisaggregatedModel,
    devices: Mapping[tuple[str, str], tuple[str, set[str]]],
) -> list[str]:  # fmt: skip
    """The engine pod claims what placement.resourceClaims names (pod resourceClaims, vllm
    container resources.claims), and the scheduler allocated each claim on a device that a
    ResourceSlice of the pod's own node publishes, reserved for this pod."""
    name, node = pod["metadata"]["name"], pod["spec"]["nodeName"]
    wanted = [c.to_json() for c in dm.spec.placement.resource_claims]
    problems = []
    if pod["spec"].get("resourceClaims", []) != wanted:
        problems.append(f"{name}: resourceClaims {pod['spec'].get('resourceClaims')}, "
                        f"expected {wanted}")  # fmt: skip
    [vllm] = [c for c in pod["spec"]["containers"] if c["name"] == "vllm"]
    claimed = [c["name"] for c in vllm.get("resources", {}).get("claims", [])]
    if claimed != [c["name"] for c in wanted]:
        problems.append(f"{name}: vllm resources.claims {claimed}")
    generated = {s["name"]: s.get("resourceClaimName")
                 for s in pod.get("status", {}).get("resourceClaimStatuses", [])}  # fmt: skip
    for entry in wanted:
        claim_name = entry.get("resourceClaimName") or generated.get(entry["name"])
        if not claim_name:
            problems.append(f"{name}: no ResourceClaim for {entry['name']}")
            continue
        path = f"{dra.RESOURCE_PATH}/namespaces/{dm.namespace}/resourceclaims/{claim_name}"
        claim = get(http, path) or {}
        status = claim.get("status", {})
        results = status.get("allocation", {}).get("devices", {}).get("results", [])
        if not results:
            problems.append(f"{name}: claim {claim_name} not allocated: {status}")
        for result in results:
            where, names = devices.get((result["driver"], result["pool"]), ("", set()))
            if where != node or result["device"] not in names:
                problems.append(f"{name} on {node}: claim {claim_name} allocated "
                                f"{result['driver']}/{result['pool']}/{result['device']}, "
                                f"not a device of {node}")  # fmt: skip
        if pod["metadata"]["uid"] not in {r.get("uid") for r in status.get("reservedFor", [])}:
            problems.append(f"{name}: claim {claim_name} not reserved for the pod")
    return problems


def placement_problems(
    pods: Sequence[Mapping[str, Any]], dm: DisaggregatedModel, profile: Profile,
    nodes: Mapping[str, Mapping[str, str]],
) -> list[str]:  # fmt: skip
    problems = []
    domain = dm.spec.placement.domain
    domains: dict[str, set[str]] = {}
    for pod in pods:
        node = pod["spec"]["nodeName"]
        labels = nodes[node]
        if profile.product is None and GPU_PRESENT_LABEL in labels:
            problems.append(f"{pod['metadata']['name']} on GPU node {node}, not a CPU node")
        if profile.product is not None and labels.get(PRODUCT_LABEL) != profile.product:
            problems.append(f"{pod['metadata']['name']} on {node} "
                            f"({labels.get(PRODUCT_LABEL)}), not {profile.product}")  # fmt: skip
        if domain is not None:
            slice_index = pod["metadata"]["labels"].get("pdserve.io/slice", "0")
            domains.setdefault(slice_index, set()).add(labels.get(domain.topology_key, "?"))
            group = pod["metadata"]["labels"].get(LWS_GROUP_KEY_LABEL)
            if group is not None:
                domains.setdefault(f"group {group[:8]}", set()).add(
                    labels.get(domain.topology_key, "?")
                )
    if domain is not None and domain.mode is Strength.required:
        split = {s: d for s, d in domains.items() if len(d) > 1}
        if split:
            problems.append(f"slices or groups split over {domain.topology_key} domains: "
                            f"{split}")  # fmt: skip
    return problems


def bound_detail(
    dm: DisaggregatedModel, engines: Sequence[Mapping[str, Any]], others: Sequence[Any]
) -> str:
    counts: dict[str, int] = {}
    for pod in [*engines, *others]:
        component = pod["metadata"]["labels"][COMPONENT_LABEL]
        counts[component] = counts.get(component, 0) + 1
    placement = dm.spec.placement
    where = ", ".join(placement.products) if not placement.engines_on_cpu else "CPU nodes"
    pools = []
    for name, pool in dm.spec.engine_pools():
        tp = f" (TP{pool.tensor_parallel_size})" if pool.tensor_parallel_size > 1 else ""
        if pool.multi_node:
            groups = counts.get(name, 0) // pool.nodes_per_replica
            tp = (f" ({groups} group(s) of {pool.nodes_per_replica} pods, DP"
                  f"{pool.data_parallel_size}{'/EP' if pool.expert_parallel else ''})")  # fmt: skip
        pools.append(f"{counts.get(name, 0)} {name}{tp}")
    text = f"{' + '.join(pools)} on {where}"
    domain = placement.domain
    if domain is not None and domain.mode is Strength.required:
        live = len({p["metadata"]["labels"].get("pdserve.io/slice") for p in engines})
        text += f", each of {live} running slice(s) in one {domain.topology_key} domain"
    if placement.resource_claims:
        claims = ", ".join(c.name for c in placement.resource_claims)
        text += f", each engine's claim ({claims}) allocated on a device of its own node"
    rest = [f"{counts[c]} {c}" for c in ("render", "gateway") if counts.get(c)]
    return text + (f"; {', '.join(rest)}" if rest else "")


def run_case(plane: ControlPlane, case: Case, nodes: Mapping[str, Mapping[str, str]]) -> Outcome:
    """One case; a ComputeDomain's channel template exists in its namespace while it runs."""
    templates = channel_templates(BODIES[case.example])
    with CHANNEL_CASES if templates else nullcontext(), plane.http() as http:
        for template in templates:  # a new ComputeDomain: a new UID
            dra.create_compute_domain_claim_template(
                http, case.namespace, template, domain_uid=str(uuid.uuid4())
            )
        try:
            return _run_case(plane, case, nodes)
        finally:
            for template in templates:
                dra.delete_compute_domain_claim_template(http, case.namespace, template)


def _run_case(plane: ControlPlane, case: Case, nodes: Mapping[str, Mapping[str, str]]) -> Outcome:
    outcome = Outcome(case)
    started = time.monotonic()
    body = restricted_to(BODIES[case.example], case.profile, case.namespace)
    name = body["metadata"]["name"]
    with plane.http() as http:
        response = http.patch(
            dm_url(case.namespace, name), params={"fieldManager": "user"},
            content=json.dumps(body), headers=APPLY, timeout=APPLY_SECONDS,
        )  # fmt: skip
        if not response.is_success:
            message = response.json().get("message", response.text)
            outcome.result, outcome.message = "refused", message
            outcome.detail = first_clause(message, case.namespace)
            outcome.problems += refusal_problems(message)
            outcome.seconds = time.monotonic() - started
            return outcome
        dm = _parsed(body, case.namespace)  # admitted: it parses
        outcome.phases["apply"] = time.monotonic() - started
        outcome.transport = transport_of(dm)
        try:
            wait_until(
                f"every pod of {case.id} bound", lambda: all_bound(http, dm), timeout=BIND_SECONDS
            )
        except ControlPlaneError:
            outcome.result = "not bound"
            outcome.detail = why_not_bound(http, dm)
            outcome.problems.append(
                f"not every pod bound within {BIND_SECONDS:.0f}s: {outcome.detail}"
            )
        else:
            outcome.result = "bound"
            pods = pods_of(http, case.namespace, {INSTANCE_LABEL: dm.name})
            component = {p["metadata"]["name"]: p["metadata"]["labels"][COMPONENT_LABEL]
                         for p in pods}  # fmt: skip
            engines = [p for p in pods if component[p["metadata"]["name"]] in ENGINES]
            others = [p for p in pods if component[p["metadata"]["name"]] in CPU_POOLS]
            outcome.detail = bound_detail(dm, engines, others)
            outcome.problems += placement_problems(engines, dm, case.profile, nodes)
            devices = slice_devices(http) if dm.spec.placement.resource_claims else {}
            for pod in engines:
                outcome.problems += wiring_problems(pod, dm)
                if dm.spec.placement.resource_claims:
                    outcome.problems += claim_problems(http, pod, dm, devices)
            for pod in others:
                outcome.problems += cpu_pod_problems(pod)
        finally:
            outcome.phases["bind"] = time.monotonic() - started
            http.delete(dm_url(case.namespace, dm.name))
            wait_until(
                f"the pods of {case.id} to go",
                lambda: not pods_of(http, case.namespace, {INSTANCE_LABEL: dm.name}),
                timeout=GONE_SECONDS,
            )
            if dm.spec.placement.resource_claims:  # the claims go with their pods
                claims = f"{dra.RESOURCE_PATH}/namespaces/{case.namespace}/resourceclaims"
                wait_until(
                    f"the resource claims of {case.id} to go",
                    lambda: not http.get(claims).json()["items"],
                    timeout=GONE_SECONDS,
                )
    outcome.seconds = time.monotonic() - started
    return outcome


# ---- the run ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fit_nodes(control_plane: ControlPlane) -> Iterator[dict[str, dict[str, str]]]:
    """The extra nodes, Ready; every node's labels by name. Removed after the module."""
    with control_plane.http() as http:
        names = create_nodes(http, FIT_NODES)
        try:
            wait_nodes_ready(http, names, timeout=60)
            items = http.get("/api/v1/nodes").json()["items"]
            yield {n["metadata"]["name"]: n["metadata"].get("labels", {}) for n in items}
        finally:
            for name in names:
                http.delete(f"/api/v1/nodes/{name}")


@pytest.fixture(scope="module")
def compute_domain_devices(
    control_plane: ControlPlane, fit_nodes: dict[str, dict[str, str]]
) -> Iterator[list[str]]:
    """What NVIDIA's DRA driver publishes where it is installed (devtools/dra.py): its
    ComputeDomain DeviceClasses, and on every GB200 tray the compute-domain kubelet plugin's
    ResourceSlice. Removed after the module."""
    trays = sorted(n for n, labels in fit_nodes.items()
                   if labels.get(PRODUCT_LABEL) == GB200.product)  # fmt: skip
    with control_plane.http() as http:
        classes = dra.install_device_classes(http)
        try:
            dra.publish_resource_slices(http, trays)
            yield trays
        finally:
            dra.delete_resource_slices(http, trays)
            for name in classes:
                http.delete(f"{dra.RESOURCE_PATH}/deviceclasses/{name}")


@pytest.fixture(scope="module")
def fit_namespaces(control_plane: ControlPlane) -> Iterator[list[str]]:
    """One namespace per profile and level, with the examples' prerequisites."""
    names = sorted({c.namespace for c in CASES})
    with control_plane.http() as http:
        try:
            for case in {c.namespace: c for c in CASES}.values():
                create_namespace(http, case.namespace, case.level)
                prerequisites(http, case.namespace)
            wait_until(
                "the model-store claims to be Bound",
                lambda: all(pvc_bound(http, n) for n in names),
                timeout=60,
            )
            yield names
        finally:
            for name in names:
                delete_namespace(http, name)


def phases(outcome: Outcome) -> str:
    return ", ".join(f"{k} done at {v:.1f}s" for k, v in outcome.phases.items())


def spans_nodes(case: Case) -> bool:
    pools = _parsed(BODIES[case.example], "x").spec.engine_pools()
    return any(pool.multi_node for _, pool in pools)


@pytest.fixture(scope="module")
def outcomes(
    control_plane: ControlPlane,
    fit_nodes: dict[str, dict[str, str]],
    fit_namespaces: list[str],
    compute_domain_devices: list[str],
    lws_manager: LwsManager,
    operator_with_webhook: RunningOperator,
) -> dict[str, Outcome]:
    """Every case, one lane per namespace (profile x level) at a time within it, the lanes
    concurrently: the nodes hold any two cases of a profile at once. Then, one at a time, the
    cases whose groups each need a whole clique of trays: a group's first pod may bind anywhere,
    and a clique another case holds a tray of could never take the rest of the group."""
    lanes: dict[str, list[Case]] = {}
    for case in CASES:
        if not spans_nodes(case):
            lanes.setdefault(case.namespace, []).append(case)

    def lane(cases: list[Case]) -> list[Outcome]:
        return [run_case(control_plane, case, fit_nodes) for case in cases]

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=LANES_AT_ONCE) as pool:
        results = [o for done in pool.map(lane, lanes.values()) for o in done]
    results += lane([case for case in CASES if spans_nodes(case)])
    elapsed = time.monotonic() - started
    slowest = sorted(results, key=lambda o: -o.seconds)[:5]
    print(f"\n{len(results)} cases in {elapsed:.1f}s; slowest: "
          + ", ".join(f"{o.case.id} {o.seconds:.1f}s ({phases(o)})" for o in slowest))  # fmt: skip
    return {o.case.id: o for o in results}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_each_case_is_bound_and_wired_or_refused_naming_field_and_fix(
    outcomes: dict[str, Outcome], case: Case
) -> None:
    outcome = outcomes[case.id]
    assert outcome.result in ("bound", "refused"), outcome.problems
    assert not outcome.problems, "\n".join(outcome.problems)


@pytest.mark.usefixtures("operator_with_webhook", "fit_nodes")
def test_a_pool_wider_than_any_node_of_its_product_is_refused_not_left_pending(
    control_plane: ControlPlane, fit_namespaces: list[str]
) -> None:
    namespace = "fit-gb200-privileged"
    spec = {"model": {"name": "Qwen/Qwen3-0.6B", "maxModelLen": 8192},
            "prefill": {"replicas": 1, "tensorParallelSize": 8}, "decode": {"replicas": 1},
            "render": {"enabled": False},
            "placement": {"gpuProducts": [GB200.product]}}  # fmt: skip
    body = {"apiVersion": "pdserve.io/v1alpha1", "kind": "DisaggregatedModel",
            "metadata": {"name": "too-wide", "namespace": namespace}, "spec": spec}  # fmt: skip
    with control_plane.http() as http:
        response = http.patch(dm_url(namespace, "too-wide"), params={"fieldManager": "user"},
                              content=json.dumps(body), headers=APPLY,
                              timeout=APPLY_SECONDS)  # fmt: skip
        if not response.is_success:
            message = response.json()["message"]
            assert "spec.prefill.tensorParallelSize" in message, message
            return
        dm = _parsed(body, namespace)
        try:
            selector = {INSTANCE_LABEL: "too-wide", COMPONENT_LABEL: "prefill"}

            def unschedulable() -> bool:
                return any(
                    c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                    for p in pods_of(http, namespace, selector)
                    for c in p.get("status", {}).get("conditions", [])
                )

            wait_until("the scheduler to give up on the prefill pod", unschedulable, timeout=60)
            raise AssertionError(f"admitted, then Pending: {why_not_bound(http, dm)}")
        finally:
            http.delete(dm_url(namespace, "too-wide"))
            wait_until(
                "the pods of too-wide to go",
                lambda: not pods_of(http, namespace, {INSTANCE_LABEL: "too-wide"}),
                timeout=GONE_SECONDS,
            )


# ---- the table -------------------------------------------------------------------------------


def render_table(outcomes: Mapping[str, Outcome]) -> str:
    lines = [
        "# Examples on GPU node profiles under Pod Security (generated)",
        "",
        "<!-- Generated by tests/cluster/test_cluster_fit.py; do not edit. Regenerate with",
        "     PDSERVE_UPDATE_TABLE=1 pytest -m cluster tests/cluster/test_cluster_fit.py -->",
        "",
        "Every file in `examples/*.yaml` (the GitOps overlays are covered by",
        "`tests/cluster/test_examples.py`), applied on the local control plane (a real",
        "kube-apiserver with its built-in PodSecurity admission, the real scheduler, kwok nodes",
        "that copy real nodes' labels and capacity: `devtools/nodes.py`) with the operator and its",
        "validating webhook running, into a namespace labelled",
        f"`{ENFORCE_LABEL}=<level>`, for every GPU profile the example may land on.",
        "",
        "- **bound**: every pod of every pool was bound by the scheduler, the engines onto nodes",
        "  of that profile, with the ports (HTTP, NIXL side channel), NIXL/UCX env, GPUs and",
        "  RDMA device/IPC_LOCK the spec asks for, and each DRA claim of",
        "  `placement.resourceClaims` allocated on a device of the engine pod's own node.",
        "- **refused**: the webhook refused the apply; the first clause of its message is shown",
        "  (the full message names the field and the fix).",
        "",
        "How the test applies each example: an example that names no GPU product is restricted",
        "to the profile by adding `placement.gpuProducts: [<product>]` (which also makes the",
        "memory-fit check judge it); the CPU examples (simulator, real vLLM's CPU build) run on",
        "the CPU nodes (a required node affinity on `nvidia.com/gpu.present` DoesNotExist is",
        "added). Its prerequisites exist: the `model-store` and `tiny-qwen3-model` PVCs and the",
        "`hf-cache` model cache PVC bound to PVs, the `qwq-chat-template` ConfigMap, the",
        "`registry-creds` pull secret and the",
        "`hf-token` Secret. The plane has no Multus: a",
        "`placement.rdma.networks` annotation is applied but attaches nothing, and no GPU node",
        "carries a taint, so tolerations are not exercised. Each case is deleted before the next",
        "one of its profile and level.",
        "",
        "NVIDIA's DRA driver for GPUs is twinned on the GB200 trays (`devtools/dra.py`): its",
        "ComputeDomain DeviceClasses, each tray's `compute-domain.nvidia.com` ResourceSlice",
        "(devices `channel-0` and `daemon-0`, neither shareable) and, in the case's namespace, the",
        "channel ResourceClaimTemplate its ComputeDomain controller creates for the example's",
        "ComputeDomain; the real scheduler allocates the claims. A tray's one channel device",
        "backs one claim, so an engine pod claiming the channel has a tray (4 GPUs) to itself: a",
        "slice of 3 TP2 engines takes 3 trays of one clique. The GB200 cliques here have 6 trays",
        "(a real NVL72 rack: 18).",
        "",
        "The KV transport column is what the pods are wired for (devices, capabilities, UCX",
        "settings), not a measurement: kwok runs no engines. What UCX really picks is measured",
        "with real NIXL in `tests/vllm/test_kv_transport.py` and between real pods in",
        "`tests/e2e/test_transport.py`; RDMA and GPUDirect only a GPU cluster can show.",
        "",
        "| Example | Profile | Pod Security | Result | Detail | KV transport (as wired) |",
        "|---|---|---|---|---|---|",
    ]
    for case in CASES:
        o = outcomes[case.id]
        detail = o.detail.replace("|", "\\|")
        lines.append(f"| {case.example} | {case.profile.name} | {case.level.value} | "
                     f"{o.result} | {detail} | {o.transport} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def test_the_table_in_docs_is_what_the_cluster_did(outcomes: dict[str, Outcome]) -> None:
    table = render_table(outcomes)
    if UPDATE:
        TABLE.write_text(table)
    assert TABLE.exists(), f"no {TABLE}: run PDSERVE_UPDATE_TABLE=1 pytest {__file__}"
    assert TABLE.read_text() == table, (
        f"{TABLE.relative_to(ROOT)} is stale: an outcome changed; rerun with "
        "PDSERVE_UPDATE_TABLE=1 and review the diff"
    )


# ---- pdserve's Pod Security judgement against the API server's ---------------------------------

VIOLATES = re.compile(r'violates PodSecurity "(?P<level>[a-z]+):[^"]*": (?P<checks>.*)$', re.S)


def api_server_checks(message: str) -> set[str]:
    """The check names of a PodSecurity refusal: 'violates PodSecurity "baseline:latest": host
    namespaces (hostNetwork=true), non-default capabilities (...)'."""
    match = VIOLATES.search(message)
    assert match is not None, message
    return {part.split(" (", 1)[0].strip() for part in split_top(match["checks"], ", ")}


def pod_templates(dm: DisaggregatedModel) -> list[tuple[str, dict[str, Any]]]:
    """Every pod template pdserve builds: the workloads and a preflight Job between two nodes."""
    objects = [*build_all(dm), *preflight(dm, {0: [NodePair("node-a", "node-b")]})]
    return [
        (f"{o['kind']}/{o['metadata']['name']}", pod_template_of(o)["spec"])
        for o in objects
        if o["kind"] in WORKLOAD_KINDS
    ]


@pytest.fixture(scope="module")
def psa_namespaces(control_plane: ControlPlane) -> Iterator[dict[PodSecurityLevel, str]]:
    names = {level: f"fit-psa-{level.value}" for level in LEVELS}
    with control_plane.http() as http:
        try:
            for level, name in names.items():
                create_namespace(http, name, level)
            yield names
        finally:
            for name in names.values():
                http.delete(f"/api/v1/namespaces/{name}")


@pytest.mark.parametrize("level", LEVELS, ids=lambda v: v.value)
@pytest.mark.parametrize("example", sorted(BODIES))
def test_pdserve_names_the_checks_the_api_server_refuses(
    control_plane: ControlPlane,
    psa_namespaces: dict[PodSecurityLevel, str],
    example: str,
    level: PodSecurityLevel,
) -> None:
    namespace = psa_namespaces[level]
    dm = _parsed(BODIES[example], namespace)
    ours: dict[str, set[str]] = {}
    theirs: dict[str, set[str]] = {}
    with control_plane.http() as http:
        for obj in build_all(dm):  # the ServiceAccounts templates name must exist
            if obj["kind"] == "ServiceAccount":
                _create(http, f"/api/v1/namespaces/{namespace}/serviceaccounts", obj)
        for workload, spec in pod_templates(dm):
            ours[workload] = {v.check for v in pod_violations(spec, level)}
            meta = {"name": "psa-check", "namespace": namespace}
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
            response = http.post(
                f"/api/v1/namespaces/{namespace}/pods", params={"dryRun": "All"}, json=pod
            )
            if response.is_success:
                theirs[workload] = set()
            else:
                message = response.json().get("message", response.text)
                assert response.status_code == 403, message
                theirs[workload] = api_server_checks(message)
    assert ours == theirs
    # The CPU pools (the Deployments: gateway, render) pass every level, restricted included:
    # the API server admitted them.
    cpu = {workload: checks for workload, checks in theirs.items()
           if workload.startswith("Deployment/")}  # fmt: skip
    assert cpu, theirs
    assert not any(cpu.values()), cpu
