"""Every example, and every object pdserve builds from it (NetworkPolicies included), passes the
real API server's validation (server-side apply, dry run): what the docs show is what a cluster
accepts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from devtools.clitools import Kubectl
from devtools.localplane import ControlPlane, build_binaries
from devtools.lws import install_lws_crd
from pdserve.api import parse_resource
from pdserve.builders import NetworkPolicyOptions, build_all
from pdserve.contract.names import FIELD_MANAGER
from pdserve.controller.diff import contains
from pdserve.kube.client import Kube
from pdserve.kube.credentials import load_credentials
from pdserve.manifests import load_resources

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("dm_crd", "lws_crd")]

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
GITOPS = Path(__file__).resolve().parents[2] / "examples" / "gitops"
# Every optional rule of the policies: metrics namespaces and each kind of gateway peer.
NETWORK = NetworkPolicyOptions(
    metrics_namespaces=("monitoring",),
    gateway_from=(
        {"namespaceSelector": {"matchLabels": {"team": "apps"}},
         "podSelector": {"matchLabels": {"app": "client"}}},
        {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
    ),
)  # fmt: skip


@pytest.fixture(scope="module")
def lws_crd(control_plane: ControlPlane) -> None:
    """The LeaderWorkerSet kind (pinned version): multi-node examples build LeaderWorkerSets."""
    install_lws_crd(control_plane, build_binaries(lws=True))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
async def test_example_and_its_children_pass_server_side_dry_run(
    control_plane: ControlPlane, namespace: str, path: Path
) -> None:
    [dm] = load_resources(path, namespace=namespace)
    kube = Kube(load_credentials(str(control_plane.kubeconfig())))
    try:
        body = dm.model_dump(by_alias=True, exclude_none=True, mode="json")
        body["metadata"] = {"name": dm.name, "namespace": namespace}
        checked = await kube.apply(body, field_manager=FIELD_MANAGER, dry_run=True)
        assert checked["spec"]["model"]["name"] == dm.spec.model.name
        for obj in build_all(dm, network=NETWORK):
            applied = await kube.apply(obj, field_manager=FIELD_MANAGER, dry_run=True)
            assert applied["metadata"]["name"] == obj["metadata"]["name"]
            assert applied["kind"] == obj["kind"]
            if obj["kind"] == "NetworkPolicy":  # stored as built: no re-apply on every resync
                assert contains(applied, obj), applied
    finally:
        await kube.close()


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_gitops_overlays_build_and_pass_server_side_dry_run(kubectl: Kubectl, overlay: str) -> None:
    built = kubectl("kustomize", str(GITOPS / "overlays" / overlay), check=True).stdout
    docs = [d for d in yaml.safe_load_all(built) if d]
    assert [d["kind"] for d in docs] == ["Namespace", "DisaggregatedModel"]
    dm = parse_resource(docs[1])
    if overlay == "dev":
        assert dm.spec.placement.accelerator_resource == ""
        assert dm.spec.image.engine.startswith("ghcr.io/pdserve/pdserve-sim")
    else:
        assert dm.spec.decode.replicas == 2
        assert dm.spec.placement.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    namespace = yaml.safe_dump(docs[0])
    kubectl("apply", "--server-side", "-f", "-", stdin=namespace, check=True)
    checked = kubectl(
        "apply",
        "--server-side",
        "--dry-run=server",
        "--validate=strict",
        "-f",
        "-",
        stdin=yaml.safe_dump(docs[1]),
    )
    assert checked.returncode == 0, checked.stderr
    for obj in build_all(dm, network=NETWORK):
        child = kubectl(
            "apply",
            "--server-side",
            "--dry-run=server",
            "--validate=strict",
            "-f",
            "-",
            stdin=yaml.safe_dump(obj),
        )
        assert child.returncode == 0, child.stderr
