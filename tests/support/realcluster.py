"""The local control plane with a real node as the end-to-end tests drive it: kubectl and helm
as its administrator, and what a user looks at (pods, the model's status, events, the
operator's log)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.clitools import ensure_cli_tools
from devtools.images import Images
from devtools.localplane import ADMIN_USER, ControlPlane
from devtools.realnode import RealNode
from pdserve.contract.names import PARITY_HASH_ANNOTATION

ROOT = Path(__file__).resolve().parents[2]
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@dataclass
class Cluster:
    plane: ControlPlane
    node: RealNode
    images: Images
    workdir: Path

    def tool(self, name: str, *args: str, check: bool = True, stdin: str | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """kubectl or helm as the cluster's administrator, offline."""
        tools = ensure_cli_tools()
        binary = {"kubectl": tools.kubectl, "helm": tools.helm}[name]
        env = {
            **os.environ,
            "KUBECONFIG": str(self.plane.kubeconfig(ADMIN_USER)),
            "HELM_CACHE_HOME": str(self.workdir / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(self.workdir / "helm" / "config"),
            "HELM_DATA_HOME": str(self.workdir / "helm" / "data"),
        }
        proc = subprocess.run(
            [str(binary), *args], input=stdin, capture_output=True, text=True, env=env,
            timeout=timeout, check=False, cwd=ROOT,
        )  # fmt: skip
        if check and proc.returncode != 0:
            raise AssertionError(f"{name} {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
        return proc

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess[str]:  # fmt: skip
        return self.tool("kubectl", *args, check=check, stdin=stdin, timeout=timeout)

    def helm(self, *args: str, check: bool = True,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:  # fmt: skip
        return self.tool("helm", *args, check=check, timeout=timeout)


CHART = ROOT / "charts" / "pdserve"
EXAMPLE = ROOT / "examples" / "sim-qwen3.yaml"
RELEASE_NAMESPACE = "pdserve-system"
MODEL_NAMESPACE = "llm"
OPERATOR_ACCOUNT = f"system:serviceaccount:{RELEASE_NAMESPACE}:pdserve"


def ensure_namespace(
    cluster: Cluster, name: str, *objects: dict[str, Any], labels: dict[str, str] | None = None
) -> None:
    """The namespace (whether or not an earlier test made it) with `labels`, and `objects`,
    applied."""
    metadata: dict[str, Any] = {"name": name, **({"labels": labels} if labels else {})}
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": metadata}
    listing = {"apiVersion": "v1", "kind": "List", "items": [namespace, *objects]}
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(listing))


def pods(cluster: Cluster, namespace: str, selector: str = "") -> list[dict[str, Any]]:
    args = ["get", "pods", "-n", namespace, "-o", "json", *(["-l", selector] if selector else [])]
    items: list[dict[str, Any]] = json.loads(cluster.kubectl(*args).stdout)["items"]
    return items


def model_status(cluster: Cluster, name: str = "sim-qwen3") -> dict[str, Any]:
    """status of a model (the simulator's by default), as `kubectl get dm -o json` shows it."""
    dm = json.loads(cluster.kubectl("get", "dm", name, "-n", MODEL_NAMESPACE, "-o", "json").stdout)
    status: dict[str, Any] = dm.get("status", {})
    return status


def ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def describe(cluster: Cluster, namespace: str) -> str:
    """What a user would look at when something is not Ready."""
    listing = cluster.kubectl("get", "pods,events", "-n", namespace, "-o", "wide", check=False)
    return listing.stdout + listing.stderr


def operator_logs(cluster: Cluster) -> str:
    # Every replica's (the leader's reconciles, the others' webhook calls), each line prefixed.
    logs = cluster.kubectl(
        "logs", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/name=pdserve", "--prefix",
        "--tail=40", check=False,
    )  # fmt: skip
    return f"\noperator log:\n{logs.stdout}{logs.stderr}"


def patch_dm(cluster: Cluster, patch: dict[str, Any]) -> None:
    cluster.kubectl("patch", "dm", "sim-qwen3", "-n", MODEL_NAMESPACE, "--type=merge",
                    "-p", json.dumps(patch))  # fmt: skip


def settled(cluster: Cluster, parity: str | None = None) -> bool:
    """Every pod of the model Ready, none terminating, all of one parity hash (`parity`)."""
    current = pods(cluster, MODEL_NAMESPACE)
    hashes = {p["metadata"]["annotations"].get(PARITY_HASH_ANNOTATION) for p in current}
    return (
        all(ready(p) and not p["metadata"].get("deletionTimestamp") for p in current)
        and len(hashes) == 1
        and (parity is None or hashes == {parity})
    )


def sigkill(cluster: Cluster, namespace: str, pod_name: str) -> None:
    """The pod's (first) container process dies as on an OOM kill or a crash: SIGKILL through
    the node's containerd, no SIGTERM, no drain; the kubelet restarts it in the same pod."""
    pod = json.loads(cluster.kubectl("get", "pod", pod_name, "-n", namespace, "-o", "json").stdout)
    container = pod["status"]["containerStatuses"][0]
    cluster.node.ctr("tasks", "kill", "--signal", "SIGKILL",
                     container["containerID"].removeprefix("containerd://"))  # fmt: skip
