"""The local control plane with a real node: pods really run (tests/cluster/realnode.py) from
images built here (tests/cluster/images.py). One plane for the whole session, started by the
first test that asks for it and stopped, leaving nothing behind, at the end."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.clitools import ensure_cli_tools
from tests.cluster.images import Images, build_images
from tests.cluster.localplane import (
    ADMIN_USER,
    OPERATOR_USER,
    ControlPlane,
    build_binaries,
)
from tests.cluster.realnode import (
    BRIDGE_ADDRESS,
    KUBELET_USER,
    PROXY_USER,
    RealNode,
    create_bridge,
    delete_bridge,
    leftovers,
)

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("e2e")
    images = build_images()
    binaries = build_binaries()
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
        yield Cluster(plane=plane, node=node, images=images, workdir=workdir)
    finally:
        node.stop()
        plane.stop()
        delete_bridge()
    left = leftovers(node)
    assert left == [], f"the real node left these behind: {left}"
