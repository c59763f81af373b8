"""The command line of each component of the local control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, kwok) and the API server's audit policy.

Only the flags live here; localplane.ControlPlane starts the processes, in order, and waits for
each to serve.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
# kwok only writes these into pod and node status; nothing is ever sent to them.
KWOK_POD_CIDR = "10.0.0.0/24"
KWOK_NODE_IP = "10.0.0.1"
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
KWOK_STAGES = Path(__file__).resolve().parent / "kwok-stages.yaml"

WRITE_VERBS = ("create", "update", "patch", "delete", "deletecollection")


def audit_policy(readers: Sequence[str]) -> dict[str, Any]:
    """Every write (tests count them, e.g. "a no-op resync performs no write"), and the reads of
    `readers` (the operator: its API requests per model are measured, measure_ready)."""
    return {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived"],
        "rules": [
            {"level": "Metadata", "verbs": list(WRITE_VERBS)},
            {"level": "Metadata", "users": list(readers), "verbs": ["get", "list", "watch"]},
            {"level": "None"},
        ],
    }


def etcd(binary: Path, *, data_dir: Path, client_url: str, peer_url: str) -> list[str]:
    return [
        str(binary),
        "--name=default",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}",
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=default={peer_url}",
        # Test data is disposable: skipping fsync makes every write several times faster.
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def kube_apiserver(
    binary: Path, *, etcd_port: int, address: str, port: int, pki: Path, ca_file: Path,
    audit_policy: Path, audit_log: Path,
) -> list[str]:  # fmt: skip
    if address == "127.0.0.1":
        # A loopback advertise address is fine for clients but not as an Endpoints address.
        routing = ["--endpoint-reconciler-type=none"]
    else:
        # Pods reach the API server through the `kubernetes` Service; the API server reaches
        # webhook Services through their endpoints, and kubelets by their InternalIP: never
        # through a resolver off the machine.
        routing = [
            "--enable-aggregator-routing=true",
            "--kubelet-preferred-address-types=InternalIP",
        ]
    return [
        str(binary),
        f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        f"--bind-address={address}",
        f"--advertise-address={address}",
        f"--secure-port={port}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={ca_file}",
        f"--token-auth-file={pki / 'tokens.csv'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        "--authorization-mode=RBAC",
        "--allow-privileged=true",
        *routing,
        f"--audit-policy-file={audit_policy}",
        f"--audit-log-path={audit_log}",
        "--audit-log-format=json",
        "--profiling=false",
    ]


def kube_controller_manager(
    binary: Path, *, kubeconfig: Path, port: int, pki: Path, ca_file: Path
) -> list[str]:
    return [
        *_controller(binary, kubeconfig=kubeconfig, port=port),
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--root-ca-file={ca_file}",
        "--controllers=*",
    ]


def kube_scheduler(binary: Path, *, kubeconfig: Path, port: int) -> list[str]:
    return _controller(binary, kubeconfig=kubeconfig, port=port)


def _controller(binary: Path, *, kubeconfig: Path, port: int) -> list[str]:
    """What the controller-manager and the scheduler share: their kubeconfig, health on a
    loopback port, and no leader election (there is only ever one of each)."""
    return [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        "--leader-elect=false",
    ]


def pod_finisher(python: str, *, kubeconfig: Path, ready_file: Path) -> list[str]:
    """devtools/pod_finisher.py: the kubelet's final, UID-guarded delete for kwok's pods."""
    key, value = KWOK_NODE_ANNOTATION
    return [python, "-m", "devtools.pod_finisher", f"--kubeconfig={kubeconfig}",
            f"--node-annotation={key}={value}", f"--ready-file={ready_file}"]  # fmt: skip


def kwok(binary: Path, *, kubeconfig: Path, port: int) -> list[str]:
    key, value = KWOK_NODE_ANNOTATION
    return [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--config={KWOK_STAGES}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={key}={value}",
        f"--cidr={KWOK_POD_CIDR}",
        f"--node-ip={KWOK_NODE_IP}",
        "--node-lease-duration-seconds=40",
        f"--server-address=127.0.0.1:{port}",
    ]
