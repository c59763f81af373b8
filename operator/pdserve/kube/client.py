"""A small async Kubernetes client for exactly what pdserve does: server-side apply, get,
list by label, delete, status patch, and the leader Lease's create/replace. Requests go over
httpx with a timeout on every call."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.contract.resource import GROUP, PLURAL, VERSION
from pdserve.kube.credentials import Credentials, bearer_auth
from pdserve.wirejson import dumps, loads_trusted


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
        Kind("v1", "Secret", "secrets"),
        Kind("v1", "Service", "services"),
        Kind("v1", "Pod", "pods"),
        Kind("v1", "Event", "events"),
        Kind("v1", "Namespace", "namespaces", namespaced=False),
        Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
        Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
        Kind("apps/v1", "StatefulSet", "statefulsets"),
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "leaderworkersets"),
        Kind("autoscaling/v2", "HorizontalPodAutoscaler", "horizontalpodautoscalers"),
        Kind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects"),
        Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
        Kind("batch/v1", "Job", "jobs"),
        Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
        Kind("coordination.k8s.io/v1", "Lease", "leases"),
        Kind("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration",
             "validatingwebhookconfigurations", namespaced=False),
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


def selectors(label_selector: str | None, field_selector: str | None) -> dict[str, str]:
    """A list's or watch's selector parameters (none when neither is given)."""
    params = {"labelSelector": label_selector} if label_selector else {}
    if field_selector:
        params["fieldSelector"] = field_selector
    return params


class KubeError(RuntimeError):
    def __init__(self, response: httpx.Response) -> None:
        self.status = response.status_code
        try:
            self.body: dict[str, Any] = response.json()
        except ValueError:
            self.body = {"message": response.text}
        super().__init__(f"{response.request.method} {response.request.url.path}: "
                         f"{self.status} {self.body.get('message', '')}")  # fmt: skip


class Kube:
    """Async client. Every call has a timeout; errors raise KubeError with the server's message."""

    def __init__(
        self, credentials: Credentials, *, timeout: float = 30.0, max_in_flight: int = 16
    ) -> None:
        """`max_in_flight`: requests sent at once, over as many kept-alive connections. Many
        models reconciled together queue here, cheaply: httpx's own pool scans every queued
        request against every connection (quadratic), and a new connection is a TLS handshake;
        with 50 models at once that was most of the operator's CPU."""
        self.client = httpx.AsyncClient(
            base_url=credentials.server,
            auth=bearer_auth(credentials),
            verify=credentials.ssl_context(),
            timeout=timeout,
            limits=httpx.Limits(
                max_connections=max_in_flight, max_keepalive_connections=max_in_flight
            ),
        )
        self._in_flight = asyncio.Semaphore(max_in_flight)
        # Watches hold their connection for minutes: on a client of their own, so that they
        # never take the request pool's few connections.
        self.watches = httpx.AsyncClient(
            base_url=credentials.server,
            auth=bearer_auth(credentials),
            verify=credentials.ssl_context(),
            timeout=timeout,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=8),
        )

    async def close(self) -> None:
        await self.client.aclose()
        await self.watches.aclose()

    async def _send(self, method: str, path: str, **kwargs: Any) -> dict[str, Any] | None:
        async with self._in_flight:
            response = await self.client.request(method, path, **kwargs)
        if response.status_code == 404 and method in ("GET", "DELETE"):
            return None
        if not response.is_success:
            raise KubeError(response)
        result: dict[str, Any] = loads_trusted(response.content)  # lists are most of what it reads
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
            content=dumps(obj),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )  # fmt: skip
        assert result is not None
        return result

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        return await self._send("GET", kind.item(namespace, name))

    async def serves(self, kind: Kind) -> bool:
        """Whether the API server serves `kind` (its CRD installed), by API discovery."""
        prefix = "/api/v1" if kind.api_version == "v1" else f"/apis/{kind.api_version}"
        found = await self._send("GET", prefix)
        resources = (found or {}).get("resources", [])
        return any(r.get("name") == kind.plural for r in resources)

    async def list(
        self,
        kind: Kind,
        namespace: str | None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        params = selectors(label_selector, field_selector)
        result = await self._send("GET", kind.collection(namespace), params=params)
        return list(result["items"]) if result else []

    async def list_versioned(
        self, kind: Kind, namespace: str | None, *, label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> tuple[builtins.list[dict[str, Any]], str]:  # fmt: skip
        """The items and the list's resourceVersion (to watch from)."""
        params = selectors(label_selector, field_selector)
        async with self._in_flight:
            response = await self.client.get(kind.collection(namespace), params=params)
        if not response.is_success:  # 404 too: the kind is not served (a CRD not installed)
            raise KubeError(response)
        result = loads_trusted(response.content)
        return list(result["items"]), str(result["metadata"]["resourceVersion"])

    async def watch(
        self, kind: Kind, namespace: str | None, *, resource_version: str,
        label_selector: str | None = None, field_selector: str | None = None,
        timeout_seconds: int = 300,
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:  # fmt: skip
        """(event type, object) as the watch from `resource_version` delivers them, bookmarks
        included, until the server ends it (after about `timeout_seconds`)."""
        params = {
            "watch": "1", "allowWatchBookmarks": "true", "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_seconds),
            **selectors(label_selector, field_selector),
        }  # fmt: skip
        # The server ends the watch after timeoutSeconds: a read that waits longer than that is
        # a connection that died without a word (a restarted API server, a dropped NAT entry).
        wait = httpx.Timeout(self.watches.timeout.connect, read=timeout_seconds + 30.0)
        async with self.watches.stream(
            "GET", kind.collection(namespace), params=params, timeout=wait
        ) as answer:
            if answer.status_code != 200:
                await answer.aread()
                raise KubeError(answer)
            async for line in answer.aiter_lines():
                if line:
                    event = loads_trusted(line)
                    yield str(event.get("type")), dict(event.get("object") or {})

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

    async def replace(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """PUT the whole object. With metadata.resourceVersion set the write is optimistic: the
        server answers 409 Conflict (a KubeError) when someone wrote the object since it was
        read, which is how a Lease update tells a replica that another one won."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        result = await self._send("PUT", kind.item(meta.get("namespace"), meta["name"]),
                                  json=dict(obj))  # fmt: skip
        assert result is not None
        return result


async def written_or_theirs(
    kube: Kube, write: Callable[[], Awaitable[Any]], kind: Kind, namespace: str, name: str
) -> dict[str, Any] | None:
    """Run `write` (a create, or a replace with the resourceVersion read): a 409 means another
    replica wrote first, and theirs stands. Read back either way: the stored object is the one
    every replica uses."""
    try:
        await write()
    except KubeError as error:
        if error.status != 409:
            raise
    return await kube.get(kind, namespace, name)
