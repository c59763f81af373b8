"""Session-scoped local control plane for tests marked ``cluster``."""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

from devtools.clitools import Kubectl, ensure_cli_tools
from devtools.localplane import (
    ControlPlane,
    build_binaries,
    free_port,
    issue_serving_cert,
    running_control_plane,
    wait_until,
)
from devtools.lws import LwsManager, running_lws
from devtools.nodes import create_nodes, demo_nodes, wait_nodes_ready
from devtools.operator_proc import RunningOperator, running_operator
from devtools.resources import get
from pdserve.api.crd import build_crd


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A running plane with the demo fake nodes Ready; stopped even when tests fail."""
    with running_control_plane(tmp_path_factory.mktemp("control-plane")) as plane:
        with plane.http() as http:
            wait_nodes_ready(http, create_nodes(http, demo_nodes()), timeout=60)
        yield plane


@pytest.fixture(scope="session")
def k8s_api(control_plane: ControlPlane) -> Iterator[Any]:
    """An official Python client (kubernetes.client.ApiClient) logged in as admin."""
    api = k8s_config.new_client_from_config(  # type: ignore[no-untyped-call]
        config_file=str(control_plane.kubeconfig())
    )
    yield api
    api.close()


@pytest.fixture
def http_api(control_plane: ControlPlane) -> Iterator[httpx.Client]:
    with control_plane.http() as http:
        yield http


@pytest.fixture
def namespace(control_plane: ControlPlane, http_api: httpx.Client) -> Iterator[str]:
    """A fresh namespace whose default ServiceAccount exists, deleted after the test."""
    name = f"t-{secrets.token_hex(4)}"
    http_api.post("/api/v1/namespaces", json={"metadata": {"name": name}}).raise_for_status()
    wait_until(
        f"the default ServiceAccount in {name}",
        lambda: http_api.get(f"/api/v1/namespaces/{name}/serviceaccounts/default").is_success,
        timeout=30,
    )
    yield name
    http_api.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture(scope="module")
def operator(
    request: pytest.FixtureRequest,
    control_plane: ControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningOperator]:
    """`pdserve operator` as its own process for the tests of one module, resyncing every
    `RESYNC_SECONDS` of that module (60 where it names none)."""
    resync = getattr(request.module, "RESYNC_SECONDS", 60)
    with running_operator(
        control_plane, tmp_path_factory.mktemp("operator"), resync_seconds=resync
    ) as running:
        yield running


WEBHOOKS = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"


@pytest.fixture(scope="module")
def operator_with_webhook(
    request: pytest.FixtureRequest,
    control_plane: ControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningOperator]:
    """`pdserve operator` with its validating webhook (kopf) registered with the API server,
    for the tests of one module, resyncing every `RESYNC_SECONDS` of that module (5 where it
    names none)."""
    resync = getattr(request.module, "RESYNC_SECONDS", 5)
    workdir = tmp_path_factory.mktemp("webhook")
    cert, key = issue_serving_cert(
        control_plane.pki, "webhook", "pdserve-webhook", ["IP:127.0.0.1"]
    )
    args = [f"--webhook-port={free_port()}", f"--webhook-cert={cert}", f"--webhook-key={key}",
            "--webhook-listen=127.0.0.1", "--webhook-host=127.0.0.1",
            f"--webhook-ca={control_plane.ca_file}", "--webhook-manage"]  # fmt: skip
    with control_plane.http() as http:
        try:
            with running_operator(
                control_plane, workdir, resync_seconds=resync, extra_args=args
            ) as running:

                def configured() -> bool:
                    # kopf creates the configuration, then fills in its webhooks: an apply in
                    # between is called on no webhook and admitted unjudged.
                    found = get(http, f"{WEBHOOKS}/validate.pdserve.io")
                    return any(hook.get("rules") for hook in (found or {}).get("webhooks") or [])

                wait_until("the webhook configuration, its rules filled in", configured,
                           timeout=30)  # fmt: skip
                yield running
        finally:
            # After the operator stopped (kopf keeps re-asserting the configuration while it
            # runs): a Fail-policy webhook with no server would block every later apply.
            http.delete(f"{WEBHOOKS}/validate.pdserve.io")


@pytest.fixture
def core_v1(k8s_api: Any) -> Any:
    return k8s_client.CoreV1Api(k8s_api)


@pytest.fixture
def apps_v1(k8s_api: Any) -> Any:
    return k8s_client.AppsV1Api(k8s_api)


@pytest.fixture(scope="session")
def kubectl(control_plane: ControlPlane) -> Kubectl:
    """Run the pinned kubectl 1.37 against the plane: kubectl("get", "nodes", check=True)."""
    binary = ensure_cli_tools().kubectl
    kubeconfig = control_plane.kubeconfig()

    def run(
        *args: str, check: bool = False, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(binary), f"--kubeconfig={kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr}")
        return proc

    return run


CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


@pytest.fixture(scope="session")
def dm_crd(control_plane: ControlPlane) -> Iterator[None]:
    """The generated DisaggregatedModel CRD, applied and Established."""
    crd = build_crd()
    name = crd["metadata"]["name"]
    with control_plane.http() as http:
        response = http.patch(
            f"{CRDS}/{name}",
            params={"fieldManager": "pdserve-tests", "force": "true"},
            content=yaml.safe_dump(crd),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        assert response.is_success, response.text

        def established() -> bool:
            status = http.get(f"{CRDS}/{name}").json().get("status") or {}
            conditions = status.get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        wait_until("the DisaggregatedModel CRD to be Established", established, timeout=30)
        yield


@pytest.fixture(scope="module")
def lws_manager(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LwsManager]:
    """The real LeaderWorkerSet controller (devtools/lws.py) for the tests of one module."""
    with running_lws(
        control_plane, tmp_path_factory.mktemp("lws"), build_binaries(lws=True)
    ) as manager:
        yield manager


@pytest.fixture(scope="module")
def http(control_plane: ControlPlane) -> Iterator[httpx.Client]:
    """One admin client for the tests of a module."""
    with control_plane.http() as client:
        yield client
