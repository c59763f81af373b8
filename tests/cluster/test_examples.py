"""Every example, and every object pdserve builds from it, passes the real API server's
validation (server-side apply, dry run): what the docs show is what a cluster accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.builders import build_all
from pdserve.builders.names import FIELD_MANAGER
from pdserve.controller.kube import Kube, load_credentials
from pdserve.manifests import load_resources
from tests.cluster.localplane import ControlPlane

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("dm_crd")]

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


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
        for obj in build_all(dm):
            applied = await kube.apply(obj, field_manager=FIELD_MANAGER, dry_run=True)
            assert applied["metadata"]["name"] == obj["metadata"]["name"]
            assert applied["kind"] == obj["kind"]
    finally:
        await kube.close()
