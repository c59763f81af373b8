"""The local control plane with a real node: pods really run (tests/cluster/realnode.py) from
images built here (tests/cluster/images.py). One plane for the tests of this package, started
by the first that asks for it and stopped after the last one, leaving nothing behind (the other
tests then run without its pods busy in the background)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.clitools import ensure_cli_tools
from tests.cluster.images import Images, build_images
from tests.cluster.localplane import (
    ADMIN_USER,
    OPERATOR_USER,
    ControlPlane,
    build_binaries,
)
from tests.cluster.nodes import create_nodes, gpu_node, wait_nodes_ready
from tests.cluster.realnode import (
    BRIDGE_ADDRESS,
    KUBELET_USER,
    PROXY_USER,
    RealNode,
    create_bridge,
    delete_bridge,
    ensure_no_other_node,
    leftovers,
)

ROOT = Path(__file__).resolve().parents[2]
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


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


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("e2e")
    images = build_images()
    binaries = build_binaries()
    ensure_no_other_node()
    # The API server listens on the node's bridge, which must exist before it starts.
    create_bridge()
    plane = ControlPlane(
        workdir=workdir / "plane", binaries=binaries, address=BRIDGE_ADDRESS,
        users=(ADMIN_USER, OPERATOR_USER, KUBELET_USER, PROXY_USER),
    )  # fmt: skip
    node = RealNode(plane=plane, workdir=workdir / "node")
    try:
        plane.start()
        node.start(images.archives)
        # The fake H200 nodes join the same plane, tainted as GPU pools usually are: pods that
        # ask for GPUs are scheduled there (kwok plays them), every other pod runs for real.
        with plane.http() as http:
            fake = [gpu_node(f"gpu-{i}", taints=(GPU_TAINT,)) for i in range(2)]
            wait_nodes_ready(http, create_nodes(http, fake), timeout=60)
        yield Cluster(plane=plane, node=node, images=images, workdir=workdir)
    finally:
        node.stop()
        plane.stop()
        delete_bridge()
    left = leftovers(node)
    assert left == [], f"the real node left these behind: {left}"


CHART = ROOT / "charts" / "pdserve"
EXAMPLE = ROOT / "examples" / "sim-qwen3.yaml"
RELEASE_NAMESPACE = "pdserve-system"
MODEL_NAMESPACE = "llm"
OPERATOR_ACCOUNT = f"system:serviceaccount:{RELEASE_NAMESPACE}:pdserve"


def pods(cluster: Cluster, namespace: str, selector: str = "") -> list[dict[str, Any]]:
    args = ["get", "pods", "-n", namespace, "-o", "json", *(["-l", selector] if selector else [])]
    items: list[dict[str, Any]] = json.loads(cluster.kubectl(*args).stdout)["items"]
    return items


def model_status(cluster: Cluster) -> dict[str, Any]:
    """status of the simulator model, as `kubectl get dm -o json` shows it."""
    dm = json.loads(
        cluster.kubectl("get", "dm", "sim-qwen3", "-n", MODEL_NAMESPACE, "-o", "json").stdout
    )
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
    logs = cluster.kubectl(
        "logs", "-n", RELEASE_NAMESPACE, "deploy/pdserve", "--tail=40", check=False
    )  # fmt: skip
    return f"\noperator log:\n{logs.stdout}{logs.stderr}"


@pytest.fixture(scope="package")
def operator(cluster: Cluster) -> Iterator[None]:
    """The chart installed as a user installs it, with the images built here."""
    cluster.helm(
        "install", "pdserve", str(CHART), "-n", RELEASE_NAMESPACE, "--create-namespace",
        # The Builtin autoscaler decides every 5 s instead of 15: the autoscaling test is shorter.
        "--set", "operator.autoscaleSeconds=5", "--wait", "--timeout", "3m",
    )  # fmt: skip
    yield
    cluster.helm("uninstall", "pdserve", "-n", RELEASE_NAMESPACE, "--wait", check=False)


@pytest.fixture(scope="package")
def model(cluster: Cluster, operator: None) -> Iterator[str]:
    """examples/sim-qwen3.yaml applied and Ready; yields the gateway Service's base URL."""
    cluster.kubectl("create", "namespace", MODEL_NAMESPACE)
    cluster.kubectl("apply", "-f", str(EXAMPLE))
    waited = cluster.kubectl(
        "wait", "--for=condition=Ready", "dm/sim-qwen3", "-n", MODEL_NAMESPACE, "--timeout=4m",
        check=False, timeout=300,
    )  # fmt: skip
    assert waited.returncode == 0, waited.stderr + describe(cluster, MODEL_NAMESPACE)
    service = json.loads(
        cluster.kubectl(
            "get", "svc", "sim-qwen3-gateway", "-n", MODEL_NAMESPACE, "-o", "json"
        ).stdout
    )
    yield f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}/v1"
    cluster.kubectl("delete", "-f", str(EXAMPLE), "--wait", check=False)
