"""Credentials for the API server, from the official client's loaders: the pod's service
account in a cluster, else a kubeconfig, whose exec plugin (EKS, GKE) pdserve runs itself, again
whenever its token nears expiry or is refused."""

from __future__ import annotations

import os
import ssl
from collections.abc import AsyncGenerator, Callable, Generator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from pdserve.kube.exec_credentials import ExecPlugin, cluster_info, parse_exec_config
from pdserve.kube.token_cache import RefreshingToken, utc_now

SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


@dataclass(frozen=True)
class Credentials:
    server: str
    ca_path: str | None = None
    insecure: bool = False
    token: str | None = None
    token_file: str | None = None  # re-read per request: in-cluster tokens rotate
    cert_file: str | None = None
    key_file: str | None = None
    # A kubeconfig's exec plugin: run again when its token nears expiry or is refused.
    exec_token: RefreshingToken | None = field(default=None, compare=False, repr=False)

    def current_token(self, rejected: str | None = None) -> str | None:
        """`rejected`: a token the API server refused; an exec plugin runs again rather than
        hand it back. Blocks while the plugin runs: async code calls `current_token_async`."""
        if self.token_file:
            with open(self.token_file) as handle:
                return handle.read().strip()
        if self.exec_token is not None:
            return self.exec_token.get(rejected).value
        return self.token.removeprefix("Bearer ") if self.token else None

    async def current_token_async(self, rejected: str | None = None) -> str | None:
        if self.exec_token is not None:
            return (await self.exec_token.aget(rejected)).value
        return self.current_token()

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_path)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.cert_file and self.key_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


def _authorized(request: httpx.Request, token: str | None) -> httpx.Request:
    if token:
        request.headers["Authorization"] = f"Bearer {token}"
    return request


class _BearerAuth(httpx.Auth):
    """The current token on every request; with an exec plugin, a 401 runs the plugin again
    (once, however many requests were refused together) and sends the request once more."""

    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self.credentials.current_token()
        response = yield _authorized(request, token)
        if response.status_code == 401 and self.credentials.exec_token is not None:
            renewed = self.credentials.current_token(rejected=token)
            if renewed != token:
                yield _authorized(request, renewed)

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        # httpx's default would drive the sync `auth_flow` on the event loop, blocking it
        # while the plugin runs.
        token = await self.credentials.current_token_async()
        response = yield _authorized(request, token)
        if response.status_code == 401 and self.credentials.exec_token is not None:
            renewed = await self.credentials.current_token_async(rejected=token)
            if renewed != token:
                yield _authorized(request, renewed)


class LoginTokens:
    """Tokens for kopf's login handler, with their expiration. kopf calls the handler again
    only once the token it got last was refused (401) or reached its expiration, and discards
    a token it saw refused: so each call after the first runs the exec plugin again, unless
    another client has already renewed the token."""

    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials
        self._last: str | None = None

    def next(self) -> tuple[str | None, datetime | None]:
        exec_token = self.credentials.exec_token
        if exec_token is None:
            return self.credentials.current_token(), None
        token = exec_token.get(rejected=self._last)
        self._last = token.value
        refresh_at = token.refresh_at
        # Not one already past: kopf would log in again at once, over and over.
        return token.value, refresh_at if refresh_at and refresh_at > exec_token.clock() else None


def _kubeconfig_loader(kubeconfig: str | None) -> Any:
    """The official client's kubeconfig loader (merging KUBECONFIG's files, the current
    context), except that an exec plugin is parsed and kept, not run."""
    from kubernetes.config import ConfigException, kube_config

    class Loader(kube_config.KubeConfigLoader):
        exec_plugin: ExecPlugin | None = None

        def _load_from_exec_plugin(self) -> bool | None:
            loader: Any = self  # the official loader's (untyped) state
            if "exec" not in loader._user:
                return None
            user = loader._current_context.value["context"].get("user")
            where = f"kubeconfig user {user!r}: exec"
            config = parse_exec_config(loader._user["exec"].value, where)
            cluster = None
            if config.provide_cluster_info:
                cluster_dir = loader._get_base_path(loader._cluster.path)
                cluster = cluster_info(loader._cluster.value, cluster_dir)
            self.exec_plugin = ExecPlugin(
                config, base_dir=loader._get_base_path(loader._user.path), cluster=cluster
            )
            return True

    location = kubeconfig or kube_config.KUBE_CONFIG_DEFAULT_LOCATION
    merged = kube_config.KubeConfigMerger(location)  # type: ignore[no-untyped-call]
    if merged.config is None:
        raise ConfigException("Invalid kube-config file. No configuration found.")
    return Loader(  # type: ignore[no-untyped-call]
        config_dict=merged.config, config_base_path=None, config_persister=merged.save_changes
    )


def load_credentials(
    kubeconfig: str | None = None, *, clock: Callable[[], datetime] = utc_now
) -> Credentials:
    """In-cluster when running in a pod (and no kubeconfig is given), else the kubeconfig
    (the given path, KUBECONFIG, or ~/.kube/config). A kubeconfig's exec plugin runs here
    once (ExecCredentialError names what is wrong), then whenever its token is due (by
    `clock`)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    token_file = None
    exec_token = None
    if kubeconfig is None and os.path.exists(SERVICE_ACCOUNT_TOKEN):
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        token_file = SERVICE_ACCOUNT_TOKEN
    else:
        loader = _kubeconfig_loader(kubeconfig)
        loader.load_and_set(configuration)
        if loader.exec_plugin is not None:
            exec_token = RefreshingToken(loader.exec_plugin.run, clock=clock)
            exec_token.get()  # now: a plugin that cannot give a token fails the start
    token = configuration.api_key.get("authorization") or configuration.api_key.get("BearerToken")
    return Credentials(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert or None,
        insecure=not configuration.verify_ssl,
        token=token,
        token_file=token_file,
        cert_file=configuration.cert_file or None,
        key_file=configuration.key_file or None,
        exec_token=exec_token,
    )


def bearer_auth(credentials: Credentials) -> httpx.Auth:
    """The token on every request: re-read each time from a rotating service-account file;
    an exec plugin's, renewed when due and retried once on a 401."""
    return _BearerAuth(credentials)
