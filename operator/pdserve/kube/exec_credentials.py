"""A kubeconfig's `users[].user.exec` credential plugin (what EKS's `aws eks get-token` and GKE's
`gke-gcloud-auth-plugin` are), run the way client-go runs it: the command with its args and env,
`KUBERNETES_EXEC_INFO` describing the request (and the cluster, with `provideClusterInfo`), and
its stdout read as an ExecCredential (client.authentication.k8s.io/v1 or v1beta1).

pdserve never has a terminal: the plugin's stdin is empty, `spec.interactive` is false, and
`interactiveMode: Always` is refused. Only tokens are taken: `clientCertificateData` and
`clientKeyData` without a `token` are refused (a client certificate would be fixed in each
client's TLS context when it is made, and could not be renewed)."""

from __future__ import annotations

import base64
import json
import os
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import httpx
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
# aws and gcloud answer in about a second, more when they renew an SSO session first.
EXEC_TIMEOUT_SECONDS = 60.0
_STDERR_TAIL = 800
# A cluster extension with this name is handed to the plugin as `spec.cluster.config`.
_EXEC_EXTENSION = "client.authentication.k8s.io/exec"


class ExecCredentialError(httpx.HTTPError):
    """The exec plugin is misconfigured, could not run, or printed no usable credential. An
    httpx error: the request it was to authenticate fails, and what retries failed requests
    (the operator's loops) retries it too."""


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, extra="ignore", frozen=True)


class ExecEnvVar(_Model):
    name: str
    value: str


class ExecConfig(_Model):
    """`users[].user.exec` in a kubeconfig."""

    # Not a Literal: the error names the versions pdserve speaks (v1alpha1 is gone from
    # client-go too).
    api_version: str
    command: str = Field(min_length=1)
    args: list[str] | None = None
    env: list[ExecEnvVar] | None = None
    interactive_mode: Literal["Never", "IfAvailable", "Always"] | None = None
    provide_cluster_info: bool = False
    install_hint: str | None = None


class ExecCredentialStatus(_Model):
    token: str | None = None
    expiration_timestamp: AwareDatetime | None = None
    client_certificate_data: str | None = None
    client_key_data: str | None = None


class ExecCredential(_Model):
    """What the plugin prints."""

    api_version: str
    kind: Literal["ExecCredential"]
    status: ExecCredentialStatus | None = None


@dataclass(frozen=True)
class IssuedToken:
    token: str
    expires: datetime | None  # None: valid until the API server refuses it


def _problems(error: ValidationError, prefix: str) -> str:
    """`prefix.field.path: message; ...` (no path for an error of the whole, as bad JSON)."""
    named = []
    for problem in error.errors():
        path = ".".join(str(part) for part in problem["loc"])
        named.append(f"{prefix}{path}: {problem['msg']}" if path else problem["msg"])
    return "; ".join(named)


def parse_exec_config(raw: Mapping[str, Any], where: str) -> ExecConfig:
    """The exec section, checked; `where` names it in errors (`kubeconfig user "eks": exec`)."""
    try:
        config = ExecConfig.model_validate(raw)
    except ValidationError as error:
        raise ExecCredentialError(_problems(error, f"{where}.")) from None
    if config.api_version not in API_VERSIONS:
        raise ExecCredentialError(
            f"{where}.apiVersion: {config.api_version!r} is not supported; use one of "
            f"{', '.join(API_VERSIONS)}"
        )
    if config.interactive_mode is None and config.api_version.endswith("/v1"):
        raise ExecCredentialError(
            f"{where}.interactiveMode is required with {config.api_version} (as in client-go): "
            "set it to Never or IfAvailable"
        )
    if config.interactive_mode == "Always":
        raise ExecCredentialError(
            f"{where}.interactiveMode: Always needs a terminal, and pdserve runs without one: "
            "set it to Never or IfAvailable, with a plugin that gets its token without asking "
            "(log in beforehand, e.g. `aws sso login`, `gcloud auth login`)"
        )
    return config


def cluster_info(cluster: Mapping[str, Any], base_dir: str) -> dict[str, Any]:
    """The kubeconfig cluster as ExecCredential's `spec.cluster` (the CA always as data);
    `base_dir`: the directory a relative `certificate-authority` path is relative to."""
    info: dict[str, Any] = {"server": cluster.get("server", "")}
    for key in ("tls-server-name", "insecure-skip-tls-verify", "proxy-url", "disable-compression"):
        if cluster.get(key) is not None:
            info[key] = cluster[key]
    ca_data = cluster.get("certificate-authority-data")
    if not ca_data and cluster.get("certificate-authority"):
        with open(os.path.join(base_dir, cluster["certificate-authority"]), "rb") as handle:
            ca_data = base64.b64encode(handle.read()).decode("ascii")
    if ca_data:
        info["certificate-authority-data"] = ca_data
    for extension in cluster.get("extensions") or []:
        if extension.get("name") == _EXEC_EXTENSION:
            info["config"] = extension.get("extension")
    return info


@dataclass(frozen=True)
class ExecPlugin:
    """One configured plugin. `base_dir`: the kubeconfig's directory (a command with a `/` in
    it is relative to it, as in client-go; a bare name is looked up in PATH); `cluster`: the
    `spec.cluster` to hand over with `provideClusterInfo`."""

    config: ExecConfig
    base_dir: str = ""
    cluster: Mapping[str, Any] | None = None
    timeout: float = EXEC_TIMEOUT_SECONDS

    def argv(self) -> list[str]:
        command = self.config.command
        if "/" in command and not os.path.isabs(command):
            command = os.path.join(self.base_dir, command)
        return [command, *(self.config.args or [])]

    def describe(self) -> str:
        shown = shlex.join(self.argv())
        return f"`{shown[:200]}{'...' if len(shown) > 200 else ''}`"

    def exec_info(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"interactive": False}
        if self.config.provide_cluster_info and self.cluster is not None:
            spec["cluster"] = dict(self.cluster)
        return {"apiVersion": self.config.api_version, "kind": "ExecCredential", "spec": spec}

    def run(self) -> IssuedToken:
        """Run the plugin once (blocking, at most `timeout` seconds) and return its token."""
        env = {**os.environ, **{var.name: var.value for var in self.config.env or []}}
        env["KUBERNETES_EXEC_INFO"] = json.dumps(self.exec_info())
        try:
            done = subprocess.run(
                self.argv(), env=env, stdin=subprocess.DEVNULL, capture_output=True,
                timeout=self.timeout, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired as error:
            raise ExecCredentialError(
                f"exec plugin {self.describe()} did not finish within {self.timeout:g} s"
                f"{_tail(error.stderr)}"
            ) from None
        except OSError as error:
            hint = f" ({self.config.install_hint.strip()})" if self.config.install_hint else ""
            raise ExecCredentialError(
                f"exec plugin {self.describe()} could not run: {error}{hint}"
            ) from None
        if done.returncode != 0:
            raise ExecCredentialError(
                f"exec plugin {self.describe()} exited with {done.returncode}{_tail(done.stderr)}"
            )
        return self._token_from(done.stdout)

    def _token_from(self, stdout: bytes) -> IssuedToken:
        printed = f"exec plugin {self.describe()} printed"
        try:
            credential = ExecCredential.model_validate_json(stdout)
        except ValidationError as error:
            raise ExecCredentialError(
                f"{printed} no valid ExecCredential: {_problems(error, '')}"
            ) from None
        if credential.api_version != self.config.api_version:
            raise ExecCredentialError(
                f"{printed} apiVersion {credential.api_version!r}, but the kubeconfig's "
                f"exec.apiVersion is {self.config.api_version!r}"
            )
        status = credential.status
        if status is None:
            raise ExecCredentialError(f"{printed} an ExecCredential without `status`")
        if not status.token:
            if status.client_certificate_data or status.client_key_data:
                raise ExecCredentialError(
                    f"{printed} status.clientCertificateData/clientKeyData and no "
                    "status.token: pdserve takes only tokens from exec plugins; configure the "
                    "plugin to issue a token, or put the client certificate into the "
                    "kubeconfig (client-certificate, client-key)"
                )
            raise ExecCredentialError(f"{printed} no status.token")
        return IssuedToken(status.token, status.expiration_timestamp)


def _tail(stderr: bytes | str | None) -> str:
    if not stderr:
        return ""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    text = text.strip()
    if not text:
        return ""
    return f": {'...' if len(text) > _STDERR_TAIL else ''}{text[-_STDERR_TAIL:]}"
