"""A kubeconfig whose user is an exec credential plugin (as EKS's and GKE's are), against the
real API server: the token renewed when it expires and when the server refuses it, by the
client the operator and the gateway use (Kube) and by the operator's kopf login handler."""

from __future__ import annotations

import asyncio
import ssl
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import kopf
import pytest

from devtools.localplane import OPERATOR_USER, ControlPlane
from devtools.operator_proc import running_operator
from devtools.resources import SMALL_PD_SPEC, apply_dm, wait_ready
from pdserve.controller.handlers import build_registry
from pdserve.controller.settings import OperatorSettings
from pdserve.kube.client import KINDS, Kube
from pdserve.kube.credentials import load_credentials
from tests.support.exec_plugin import ScriptedPlugin, credential, with_exec_user

pytestmark = pytest.mark.cluster

NAMESPACE = KINDS[("v1", "Namespace")]
POD = KINDS[("v1", "Pod")]


class Plane:
    """The plugin, a kubeconfig running it (with the plane's cluster info), and the admin
    token the plugin hands out as the valid one."""

    def __init__(self, control_plane: ControlPlane, workdir: Path, user: str | None = None) -> None:
        self.plugin = ScriptedPlugin(workdir / "plugin")
        self.kubeconfig = workdir / "kubeconfig-exec"
        admin = control_plane.kubeconfig() if user is None else control_plane.kubeconfig(user)
        self.valid = with_exec_user(
            admin, self.kubeconfig,
            self.plugin.exec_section(provideClusterInfo=True),
        )  # fmt: skip
        self.server = control_plane.server
        self.ca_file = control_plane.ca_file

    def status_with(self, token: str | None) -> int:
        """What the API server answers a request with `token`."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        context = ssl.create_default_context(cafile=self.ca_file)
        with httpx.Client(base_url=self.server, verify=context, headers=headers) as http:
            return http.get("/api/v1/namespaces/default").status_code


@pytest.fixture
def plane(control_plane: ControlPlane, tmp_path: Path) -> Plane:
    return Plane(control_plane, tmp_path)


def from_now(**delta: float) -> datetime:
    return datetime.now(UTC) + timedelta(**delta)


async def test_an_expired_token_is_renewed_before_the_next_request(plane: Plane) -> None:
    # A token a couple of seconds from expiry, then one for an hour; the clock is ours, moved
    # past the first expiry between two requests (no sleeping).
    plane.plugin.answer(credential(plane.valid, from_now(seconds=2)),
                        credential(plane.valid, from_now(hours=1)))  # fmt: skip
    now = datetime.now(UTC)
    kube = Kube(load_credentials(str(plane.kubeconfig), clock=lambda: now))
    try:
        assert plane.plugin.runs == 1  # at load
        assert await kube.get(NAMESPACE, None, "default") is not None
        assert plane.plugin.runs == 1  # still valid: not run again
        now += timedelta(seconds=3)  # the first token has expired
        assert await kube.get(NAMESPACE, None, "default") is not None
        assert plane.plugin.runs == 2
        assert isinstance(await kube.list(POD, "default"), list)
        assert plane.plugin.runs == 2
    finally:
        await kube.close()
    # The plugin was told which cluster it was for (provideClusterInfo).
    cluster = plane.plugin.exec_info(0)["spec"]["cluster"]
    assert cluster["server"] == plane.server
    assert "certificate-authority-data" in cluster


async def test_a_refused_token_is_renewed_and_the_request_retried(plane: Plane) -> None:
    plane.plugin.answer(credential("not-a-token", from_now(hours=1)),
                        credential(plane.valid, from_now(hours=1)))  # fmt: skip
    assert plane.status_with("not-a-token") == 401
    kube = Kube(load_credentials(str(plane.kubeconfig)))
    try:
        assert await kube.get(NAMESPACE, None, "default") is not None
        assert plane.plugin.runs == 2
        assert await kube.get(NAMESPACE, None, "kube-system") is not None
        assert plane.plugin.runs == 2
    finally:
        await kube.close()


async def test_concurrent_refused_requests_and_a_watch_renew_once(plane: Plane) -> None:
    plane.plugin.answer(credential("not-a-token", from_now(hours=1)),
                        credential(plane.valid, from_now(hours=1)))  # fmt: skip
    kube = Kube(load_credentials(str(plane.kubeconfig)))

    async def watch() -> None:
        # The watch client (the informer's, the gateway's pod discovery) renews too.
        async for _ in kube.watch(POD, "default", resource_version="0", timeout_seconds=1):
            pass  # until the server ends it: answered 200, not 401

    try:
        watching = asyncio.create_task(watch())
        got = await asyncio.gather(*(kube.get(NAMESPACE, None, "default") for _ in range(10)))
        await watching
        assert all(g is not None for g in got)
        assert plane.plugin.runs == 2
    finally:
        await kube.close()


def login_handler(registry: kopf.OperatorRegistry) -> Any:
    [found] = [h.fn for h in registry._activities.get_all_handlers()
               if getattr(h.fn, "__name__", "") == "login"]  # fmt: skip
    return found


async def test_the_operators_kopf_login_gets_a_new_token_after_a_401(plane: Plane) -> None:
    plane.plugin.answer(credential("not-a-token", from_now(hours=1)),
                        credential(plane.valid, from_now(hours=1)))  # fmt: skip
    credentials = load_credentials(str(plane.kubeconfig))
    registry, _ = build_registry(credentials, OperatorSettings())
    login = login_handler(registry)
    # kopf runs sync login handlers in its executor: so do we.
    first = await asyncio.to_thread(login)
    assert (first.server, first.token) == (plane.server, "not-a-token")
    assert first.expiration is not None
    assert plane.status_with(first.token) == 401
    # kopf discards the refused token and calls its login handlers again.
    second = await asyncio.to_thread(login)
    assert second.token == plane.valid
    assert plane.plugin.runs == 2
    assert plane.status_with(second.token) == 200
    # The operator's own client shares the renewed token: no further run.
    kube = Kube(credentials)
    try:
        assert await kube.get(NAMESPACE, None, "default") is not None
    finally:
        await kube.close()
    assert plane.plugin.runs == 2


@pytest.mark.usefixtures("dm_crd")
def test_the_operator_process_recovers_from_a_refused_first_token(
    control_plane: ControlPlane, tmp_path: Path, http_api: httpx.Client, namespace: str
) -> None:
    """`pdserve operator` with the kubeconfig (its own user's token as the valid one): kopf's
    watches and the reconciler's client are both refused at first, and both carry on."""
    operator_plane = Plane(control_plane, tmp_path, user=OPERATOR_USER)
    operator_plane.plugin.answer(credential("not-a-token", from_now(hours=1)),
                                 credential(operator_plane.valid, from_now(hours=1)))  # fmt: skip
    args = [f"--kubeconfig={operator_plane.kubeconfig}"]  # the last --kubeconfig wins
    (tmp_path / "operator").mkdir()
    with running_operator(
        control_plane, tmp_path / "operator", resync_seconds=3600, extra_args=args
    ) as running:
        apply_dm(http_api, namespace, "qwen", SMALL_PD_SPEC)
        wait_ready(http_api, namespace, "qwen")
        log = running.log.read_text()
    assert "Re-authentication has finished" in log
    assert operator_plane.plugin.runs == 2
