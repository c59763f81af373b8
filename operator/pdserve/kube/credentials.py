"""Credentials for the API server, from the official client's loaders: the pod's service
account in a cluster, else a kubeconfig."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Any

import httpx

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

    def current_token(self) -> str | None:
        if self.token_file:
            with open(self.token_file) as handle:
                return handle.read().strip()
        return self.token.removeprefix("Bearer ") if self.token else None

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_path)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.cert_file and self.key_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


class _BearerAuth(httpx.Auth):
    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials

    def auth_flow(self, request: httpx.Request) -> Any:
        token = self.credentials.current_token()
        if token:
            request.headers["Authorization"] = f"Bearer {token}"
        yield request


def load_credentials(kubeconfig: str | None = None) -> Credentials:
    """In-cluster when running in a pod (and no kubeconfig is given), else the kubeconfig
    (the given path, KUBECONFIG, or ~/.kube/config)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    token_file = None
    if kubeconfig is None and os.path.exists(SERVICE_ACCOUNT_TOKEN):
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        token_file = SERVICE_ACCOUNT_TOKEN
    else:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, client_configuration=configuration
        )
    token = configuration.api_key.get("authorization") or configuration.api_key.get("BearerToken")
    return Credentials(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert or None,
        insecure=not configuration.verify_ssl,
        token=token,
        token_file=token_file,
        cert_file=configuration.cert_file or None,
        key_file=configuration.key_file or None,
    )


def bearer_auth(credentials: Credentials) -> httpx.Auth:
    """The token on every request, re-read each time from a rotating service-account file."""
    return _BearerAuth(credentials)
