"""Labels, annotations, ports and timings of the objects the operator creates, as the
processes inside them (the gateway's discovery, the engines) read them back
(docs/architecture.md)."""

from __future__ import annotations

from enum import StrEnum

FIELD_MANAGER = "pdserve"
PARITY_HASH_ANNOTATION = "pdserve.io/parity-hash"
# On prefill and decode pods (and their pools in the routing config): a digest of every input of
# NIXL's KV-transfer compatibility check; the gateway pairs only prefill and decode pods whose
# digests are equal (builders/kv_compat.py).
KV_COMPAT_ANNOTATION = "pdserve.io/kv-compat"
CONFIG_HASH_ANNOTATION = "pdserve.io/config-hash"
# On gateway pods: a digest of the peer key they read at start-up, so a new key rolls them.
PEER_KEY_HASH_ANNOTATION = "pdserve.io/peer-key-hash"
MODEL_LABEL = "pdserve.io/model"
SLICE_LABEL = "pdserve.io/slice"
# On engine pods, set by the operator from the slice's preflight; the gateway reads it.
KV_TRANSPORT_ANNOTATION = "pdserve.io/kv-transport"
COMPONENT_LABEL = "app.kubernetes.io/component"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "pdserve"
# Everything pdserve made (its children and their pods), as a label selector.
MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"


def children_selector(model: str) -> str:
    """What pdserve made for one model, as a label selector."""
    return f"{INSTANCE_LABEL}={model},{MANAGED_SELECTOR}"


ENGINE_PORT = 8000
# What LeaderWorkerSet (sigs.k8s.io/lws v0.7.0) sets on every pod of a group: labels from its pod
# webhook (the group's key, index and the pod's index in it; the name from its controller) and
# the group's size as an annotation. The operator counts groups by them; the gateway routes to a
# group's pods only while all of them are Ready.
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
LWS_SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
# The ZMQ port of a multi-node replica's DP coordination on its leader, the same on every node
# (vLLM 0.32's default for --data-parallel-rpc-port, config/parallel.py).
DATA_PARALLEL_RPC_PORT = 29550
RENDER_PORT = 8000
GATEWAY_CONTAINER_PORT = 8000
# Where the pdserve image carries the gateway's compiled data plane (images/Dockerfile).
DATA_PLANE_BINARY = "/usr/local/bin/pdserve-dataplane"
# A gateway keeps serving this long after SIGTERM (`--drain-seconds`), while kube-proxy and load
# balancers stop sending it new connections, each answer closing its connection; then it finishes
# in-flight requests (the gateway's own shutdown timeout) within the rest of the grace period.
GATEWAY_DRAIN_SECONDS = 5
GATEWAY_SHUTDOWN_SECONDS = 30
# The gateway replicas' own credential for each other's /status and /admission* (its key inside
# the Secret <model>-gateway-peer-key): derived by the operator, never a client's API key.
PEER_KEY_SECRET_KEY = "peer-key"


# The operator's master key, from which it derives every model's peer key (HMAC): one Secret in
# the operator's own namespace, the only Secret it may read (RBAC: get on this name alone).
PEER_MASTER_SECRET_NAME = "pdserve-operator-peer-master"
PEER_MASTER_SECRET_KEY = "master-key"

# The Lease the operator replicas elect their leader with, in the operator's own namespace (the
# chart's RBAC grants get/update on this name alone).
LEADER_LEASE_NAME = "pdserve-operator-leader"

# The gateway's replica checks report a pod that disagrees with its group (or rejoins it) in
# Events on the pod from this reporter; the operator reads them into ContractVerified.
GATEWAY_EVENT_REPORTER = "pdserve-gateway"
REPLICA_MISMATCH_REASON = "ReplicaContractMismatch"
REPLICA_UNCHECKED_REASON = "ReplicaContractUnchecked"
REPLICA_VERIFIED_REASON = "ReplicaContractVerified"


def peer_key_secret_name(model: str) -> str:
    return f"{model}-gateway-peer-key"


class Component(StrEnum):
    prefill = "prefill"
    decode = "decode"
    render = "render"
    gateway = "gateway"
    preflight = "preflight"
