"""An operator upgrade moves the gateways with it: a model that names no gateway image runs the
operator's own (its --gateway-image, which the chart sets to its image), so the next operator
version rolls those gateways to itself without anyone editing the model; a model that pins one
keeps it. Two operator processes one after the other on the real API server, as `helm upgrade`
replaces the operator's pod."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from devtools.localplane import ControlPlane, wait_until
from devtools.operator_proc import running_operator
from devtools.resources import SMALL_PD_SPEC, apply_dm, dm_url, get, wait_ready

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("dm_crd")]

OLD, NEW = "registry.example/pdserve:0.1.9", "registry.example/pdserve:0.2.0"
PINNED = "registry.example/pdserve:0.1.5"


def gateway_image(http: httpx.Client, namespace: str, name: str) -> str:
    deployment = get(http, f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}-gateway")
    assert deployment is not None
    return str(deployment["spec"]["template"]["spec"]["containers"][0]["image"])


def test_an_operator_upgrade_moves_the_gateways_that_name_no_image(
    control_plane: ControlPlane, http_api: httpx.Client, namespace: str, tmp_path: Path
) -> None:
    pinned = {**SMALL_PD_SPEC, "image": {"gateway": PINNED}}
    (tmp_path / "old").mkdir()
    with running_operator(control_plane, tmp_path / "old", resync_seconds=60,
                          extra_args=[f"--gateway-image={OLD}"]):  # fmt: skip
        apply_dm(http_api, namespace, "follows", SMALL_PD_SPEC)
        apply_dm(http_api, namespace, "pinned", pinned)
        wait_ready(http_api, namespace, "follows")
        wait_ready(http_api, namespace, "pinned")
        assert gateway_image(http_api, namespace, "follows") == OLD
    stored = get(http_api, dm_url(namespace, "follows"))
    assert stored is not None
    assert "gateway" not in stored["spec"].get("image", {})  # nothing defaulted into the object
    (tmp_path / "new").mkdir()
    with running_operator(control_plane, tmp_path / "new", resync_seconds=60,
                          extra_args=[f"--gateway-image={NEW}"]):  # fmt: skip
        wait_until(
            "the new operator to roll the gateway to its own image",
            lambda: gateway_image(http_api, namespace, "follows") == NEW,
            timeout=60,
        )
        wait_ready(http_api, namespace, "follows")
        assert gateway_image(http_api, namespace, "pinned") == PINNED
