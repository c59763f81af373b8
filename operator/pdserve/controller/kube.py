"""A small async Kubernetes client for exactly what the operator does: server-side apply, get,
list by label, delete, status patch. Credentials come from the official client's loaders
(kubeconfig or in-cluster), requests go over httpx with a timeout on every call."""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.api import GROUP, PLURAL, VERSION


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    def collection(self, namespace: str | None) -> str:
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced and namespace:
            return f"{prefix}/namespaces/{namespace}/{self.plural}"
        return f"{prefix}/{self.plural}"

    def item(self, namespace: str | None, name: str) -> str:
        return f"{self.collection(namespace)}/{name}"


KINDS: dict[tuple[str, str], Kind] = {
    (k.api_version, k.kind): k
    for k in (
        Kind("v1", "ServiceAccount", "serviceaccounts"),
        Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "Service", "services"),
        Kind("v1", "Pod", "pods"),
        Kind("v1", "Event", "events"),
        Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
        Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
        Kind("apps/v1", "StatefulSet", "statefulsets"),
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
        Kind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects"),
        Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
        Kind("batch/v1", "Job", "jobs"),
        Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
        Kind(f"{GROUP}/{VERSION}", "DisaggregatedModel", PLURAL),
        Kind("apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions",
             namespaced=False),
    )
}  # fmt: skip


def kind_of(obj: Mapping[str, Any]) -> Kind:
    key = (obj["apiVersion"], obj["kind"])
    if key not in KINDS:
        raise KeyError(f"pdserve does not manage {key[1]} ({key[0]})")
    return KINDS[key]


class KubeError(RuntimeError):
    def __init__(self, response: httpx.Response) -> None:
        self.status = response.status_code
        try:
            self.body: dict[str, Any] = response.json()
        except ValueError:
            self.body = {"message": response.text}
        super().__init__(f"{response.request.method} {response.request.url.path}: "
                         f"{self.status} {self.body.get('message', '')}")  # fmt: skip


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


class Kube:
    """Async client. Every call has a timeout; errors raise KubeError with the server's message."""

    def __init__(self, credentials: Credentials, *, timeout: float = 30.0) -> None:
        self.client = httpx.AsyncClient(
            base_url=credentials.server,
            auth=_BearerAuth(credentials),
            verify=credentials.ssl_context(),
            timeout=timeout,
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def _send(self, method: str, path: str, **kwargs: Any) -> dict[str, Any] | None:
        response = await self.client.request(method, path, **kwargs)
        if response.status_code == 404 and method in ("GET", "DELETE"):
            return None
        if not response.is_success:
            raise KubeError(response)
        result: dict[str, Any] = response.json()
        return result

    async def apply(
        self, obj: Mapping[str, Any], *, field_manager: str, force: bool = True,
        dry_run: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """Server-side apply; force takes over fields another manager holds (kubectl edits)."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        if dry_run:
            params["dryRun"] = "All"
        result = await self._send(
            "PATCH", kind.item(meta.get("namespace"), meta["name"]), params=params,
            # JSON, not YAML: the server's YAML 1.2 parser reads an unquoted "123e4567" (which
            # PyYAML leaves unquoted) as a number.
            content=json.dumps(obj),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )  # fmt: skip
        assert result is not None
        return result

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        return await self._send("GET", kind.item(namespace, name))

    async def list(
        self, kind: Kind, namespace: str | None, *, label_selector: str | None = None
    ) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else {}
        result = await self._send("GET", kind.collection(namespace), params=params)
        return list(result["items"]) if result else []

    async def delete(self, kind: Kind, namespace: str | None, name: str) -> None:
        await self._send("DELETE", kind.item(namespace, name),
                         json={"propagationPolicy": "Background"})  # fmt: skip

    async def patch_merge(
        self, kind: Kind, namespace: str, name: str, patch: Mapping[str, Any],
        subresource: str = "",
    ) -> dict[str, Any]:  # fmt: skip
        """JSON merge patch (RFC 7386), for fields pdserve does not own by apply."""
        path = kind.item(namespace, name) + (f"/{subresource}" if subresource else "")
        result = await self._send(
            "PATCH", path, json=dict(patch),
            headers={"Content-Type": "application/merge-patch+json"},
        )  # fmt: skip
        assert result is not None
        return result

    async def patch_status(
        self, kind: Kind, namespace: str, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        return await self.patch_merge(kind, namespace, name, {"status": dict(status)}, "status")

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        kind = kind_of(obj)
        result = await self._send(
            "POST", kind.collection(obj["metadata"].get("namespace")), json=dict(obj)
        )
        assert result is not None
        return result
