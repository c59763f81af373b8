"""The local control plane with a real node: pods really run (devtools/realnode.py) from
images built here (devtools/images.py). One plane for the tests of this package, started
by the first that asks for it and stopped after the last one, leaving nothing behind (the other
tests then run without its pods busy in the background)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.images import build_images
from devtools.localplane import (
    ADMIN_USER,
    OPERATOR_USER,
    ControlPlane,
    build_binaries,
)
from devtools.nodes import create_nodes, gpu_node, wait_nodes_ready
from devtools.realnode import (
    BRIDGE_ADDRESS,
    KUBELET_USER,
    PROXY_USER,
    RealNode,
    create_bridge,
    delete_bridge,
    ensure_no_other_node,
    leftovers,
)
from devtools.registry import Registry, running_registry
from tests.support.markers import mark_package
from tests.support.realcluster import (
    CHART,
    EXAMPLE,
    GPU_TAINT,
    MODEL_NAMESPACE,
    RELEASE_NAMESPACE,
    Cluster,
    describe,
    ensure_namespace,
)

# Real vLLM first, before the simulator model exists: its three engines, render pool and the
# preflight probe's two pods need the real node's two cores to themselves (the probe asks 500m
# each), and its NIXL engines, polling, are gone before the simulator's tests measure anything.
FIRST = "test_real_vllm.py"
HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_package(items, __file__, pytest.mark.e2e)
    # This hook sees the whole session: only this package's run of items is reordered, in place.
    here = [i for i, item in enumerate(items) if HERE in item.path.parents]
    ordered = sorted((items[i] for i in here), key=lambda item: item.path.name != FIRST)
    for i, item in zip(here, ordered, strict=True):
        items[i] = item


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


@pytest.fixture(scope="package")
def registry(cluster: Cluster) -> Iterator[Registry]:
    """A real registry (TLS, the plane's CA) the node trusts and pulls from, as a team's own."""
    with running_registry(cluster.workdir / "registry", build_binaries(), cluster.plane) as running:
        cluster.node.trust_registry(running.host, running.ca_file)
        yield running


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
    # The real-vLLM tests, which run first, may have made it.
    ensure_namespace(cluster, MODEL_NAMESPACE)
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
