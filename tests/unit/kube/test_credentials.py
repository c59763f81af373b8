"""Credentials from a kubeconfig whose user is an exec plugin: run once at load, the token on
every request, a 401 answered by one more run and one retry, kopf's login handed a new token
each time it asks again. (Against a real API server: tests/cluster/test_exec_credentials.py.)"""

from __future__ import annotations

import asyncio
import base64
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from pdserve.kube.client import KINDS, Kube, KubeError
from pdserve.kube.credentials import Credentials, LoginTokens, bearer_auth, load_credentials
from pdserve.kube.exec_credentials import ExecCredentialError
from tests.support.exec_plugin import ScriptedPlugin, credential, write_kubeconfig

SERVER = "https://api.test"
POD = KINDS[("v1", "Pod")]


@pytest.fixture
def scripted(tmp_path: Path) -> ScriptedPlugin:
    return ScriptedPlugin(tmp_path / "plugin")


def exec_credentials(tmp_path: Path, scripted: ScriptedPlugin) -> Credentials:
    kubeconfig = write_kubeconfig(
        tmp_path / "kubeconfig", server=SERVER, user={"exec": scripted.exec_section()}
    )
    return load_credentials(str(kubeconfig))


def kube_answering(credentials: Credentials, valid: set[str], seen: list[str]) -> Kube:
    """A Kube whose API server accepts the `valid` tokens and records every one it is sent."""

    def handler(request: httpx.Request) -> httpx.Response:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        seen.append(token)
        if token not in valid:
            return httpx.Response(401, json={"kind": "Status", "message": "Unauthorized"})
        return httpx.Response(200, json={"metadata": {"name": "p"}})

    kube = Kube(credentials)
    kube.client = httpx.AsyncClient(
        base_url=SERVER, auth=bearer_auth(credentials), transport=httpx.MockTransport(handler)
    )
    return kube


def test_the_plugin_runs_once_at_load(tmp_path: Path, scripted: ScriptedPlugin) -> None:
    scripted.answer(credential("tok-1", datetime.now(UTC) + timedelta(hours=1)))
    credentials = exec_credentials(tmp_path, scripted)
    assert credentials.server == SERVER
    assert credentials.token is None
    assert scripted.runs == 1
    assert credentials.current_token() == "tok-1"
    assert scripted.runs == 1


def test_a_static_token_kubeconfig_is_unchanged(tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", server=SERVER, user={"token": "static"})
    credentials = load_credentials(str(kubeconfig))
    assert credentials.exec_token is None
    assert credentials.current_token() == "static"
    assert credentials.current_token(rejected="static") == "static"


def test_interactive_mode_always_fails_the_load_before_running(
    tmp_path: Path, scripted: ScriptedPlugin
) -> None:
    kubeconfig = write_kubeconfig(
        tmp_path / "kubeconfig", server=SERVER,
        user={"exec": scripted.exec_section(interactiveMode="Always")},
    )  # fmt: skip
    with pytest.raises(ExecCredentialError, match=r"user 'u': exec\.interactiveMode: Always"):
        load_credentials(str(kubeconfig))
    assert scripted.runs == 0


def test_a_broken_plugin_fails_the_load(tmp_path: Path, scripted: ScriptedPlugin) -> None:
    scripted.plan({"stdout": "", "stderr": "no SSO session", "exit": 255})
    with pytest.raises(ExecCredentialError, match="exited with 255: no SSO session"):
        exec_credentials(tmp_path, scripted)


def test_provide_cluster_info_gets_the_kubeconfigs_cluster(
    tmp_path: Path, scripted: ScriptedPlugin
) -> None:
    scripted.answer(credential("tok"))
    (tmp_path / "ca.crt").write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    kubeconfig = write_kubeconfig(
        tmp_path / "kubeconfig", server=SERVER, cluster={"certificate-authority": "ca.crt"},
        user={"exec": scripted.exec_section(provideClusterInfo=True)},
    )  # fmt: skip
    credentials = load_credentials(str(kubeconfig))
    assert credentials.ca_path == str(tmp_path / "ca.crt")
    assert scripted.exec_info(0)["spec"]["cluster"] == {
        "server": SERVER,
        "certificate-authority-data": base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode(),
    }


def revoked_then_good(tmp_path: Path, scripted: ScriptedPlugin) -> tuple[Kube, list[str]]:
    """A Kube whose plugin first hands out a token the server refuses, then one it accepts;
    and the tokens the server saw, in order."""
    far = datetime.now(UTC) + timedelta(hours=1)
    scripted.answer(credential("revoked", far), credential("good", far))
    seen: list[str] = []
    return kube_answering(exec_credentials(tmp_path, scripted), {"good"}, seen), seen


async def test_a_401_runs_the_plugin_again_and_retries_once(
    tmp_path: Path, scripted: ScriptedPlugin
) -> None:
    kube, seen = revoked_then_good(tmp_path, scripted)
    assert await kube.get(POD, "ns", "p") == {"metadata": {"name": "p"}}
    assert seen == ["revoked", "good"]
    assert scripted.runs == 2
    assert await kube.get(POD, "ns", "p") is not None
    assert seen[2:] == ["good"]
    await kube.close()


async def test_concurrent_401s_run_the_plugin_once(
    tmp_path: Path, scripted: ScriptedPlugin
) -> None:
    kube, seen = revoked_then_good(tmp_path, scripted)
    got = await asyncio.gather(*(kube.get(POD, "ns", f"p{i}") for i in range(12)))
    assert all(g is not None for g in got)
    assert scripted.runs == 2
    assert seen.count("good") == 12
    await kube.close()


async def test_a_token_refused_again_is_not_retried_again(
    tmp_path: Path, scripted: ScriptedPlugin
) -> None:
    scripted.answer(credential("revoked"), credential("also-revoked"))
    seen: list[str] = []
    kube = kube_answering(exec_credentials(tmp_path, scripted), set(), seen)
    with pytest.raises(KubeError) as raised:
        await kube.get(POD, "ns", "p")
    assert raised.value.status == 401
    assert seen == ["revoked", "also-revoked"]
    await kube.close()


async def test_the_same_token_again_is_not_retried(
    tmp_path: Path, scripted: ScriptedPlugin
) -> None:
    scripted.answer(credential("revoked"))  # a plugin that caches its token itself
    seen: list[str] = []
    kube = kube_answering(exec_credentials(tmp_path, scripted), set(), seen)
    with pytest.raises(KubeError):
        await kube.get(POD, "ns", "p")
    assert seen == ["revoked"]
    assert scripted.runs == 2
    await kube.close()


async def test_static_tokens_are_not_retried() -> None:
    seen: list[str] = []
    kube = kube_answering(Credentials(server=SERVER, token="static"), set(), seen)
    with pytest.raises(KubeError):
        await kube.get(POD, "ns", "p")
    assert seen == ["static"]
    await kube.close()


def test_a_sync_client_retries_too(tmp_path: Path, scripted: ScriptedPlugin) -> None:
    scripted.answer(credential("revoked"), credential("good"))
    credentials = exec_credentials(tmp_path, scripted)

    def handler(request: httpx.Request) -> httpx.Response:
        ok = request.headers["Authorization"] == "Bearer good"
        return httpx.Response(200 if ok else 401)

    with httpx.Client(
        base_url=SERVER, auth=bearer_auth(credentials), transport=httpx.MockTransport(handler)
    ) as client:
        assert client.get("/api").status_code == 200
    assert scripted.runs == 2


def test_kopf_login_gets_a_new_token_each_time_it_asks_again(
    tmp_path: Path, scripted: ScriptedPlugin
) -> None:
    far = datetime.now(UTC) + timedelta(hours=1)
    past = datetime.now(UTC) - timedelta(minutes=1)
    scripted.answer(credential("tok-1", far), credential("tok-2", past), credential("tok-3"))
    logins = LoginTokens(exec_credentials(tmp_path, scripted))
    token, expiration = logins.next()  # kopf's first login: the token loaded at start
    assert token == "tok-1"
    assert expiration is not None
    assert far - timedelta(seconds=11) < expiration < far  # renewed a little before
    assert scripted.runs == 1
    # kopf asks again only once tok-1 was refused (or expired): never tok-1 again.
    assert logins.next() == ("tok-2", None)  # already expired: no expiration for kopf
    assert logins.next() == ("tok-3", None)  # none given: kept until refused
    assert scripted.runs == 3


def test_kopf_login_with_a_static_token() -> None:
    logins = LoginTokens(Credentials(server=SERVER, token="static"))
    assert logins.next() == ("static", None)
    assert logins.next() == ("static", None)
