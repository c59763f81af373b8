"""In-cluster discovery: list and watch the model's Pods (namespace-scoped RBAC) and keep every
pool's endpoints current: ready pods only, addressed by pod IP, each with its parity hash (and,
engines, its KV-compatibility digest)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import httpx

from pdserve.contract.names import (
    KV_COMPAT_ANNOTATION,
    KV_TRANSPORT_ANNOTATION,
    PARITY_HASH_ANNOTATION,
    SLICE_LABEL,
)
from pdserve.contract.routing import GatewayConfig, PoolRef
from pdserve.gateway.endpoints import Endpoint, Endpoints
from pdserve.gateway.peers import PeerAdmission
from pdserve.kube.client import KINDS, Kube, KubeError

log = logging.getLogger("pdserve.gateway.discovery")
POD = KINDS[("v1", "Pod")]


def pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status", {})
    if pod.get("metadata", {}).get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", [])
    )


def matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


class PodDiscovery:
    def __init__(
        self,
        kube: Kube,
        config: GatewayConfig,
        endpoints: Endpoints,
        peers: PeerAdmission | None = None,
        own_pod: str | None = None,
    ) -> None:
        self.kube, self.config, self.endpoints = kube, config, endpoints
        self.peers, self.own_pod = peers, own_pod
        self.pools: dict[str, PoolRef] = {
            name: ref
            for name in ("render", "prefill", "decode")
            if (ref := getattr(config.pools, name)) is not None
        }
        # One watch for all pools: the labels every pool selector shares (the model's instance).
        selectors = [ref.selector for ref in self.pools.values()]
        common = {k: v for k, v in selectors[0].items() if all(s.get(k) == v for s in selectors)}
        self.selector = ",".join(f"{k}={v}" for k, v in sorted(common.items()))
        self.pods: dict[str, dict[str, Any]] = {}
        self.synced = asyncio.Event()

    def publish(self) -> None:
        for pool, ref in self.pools.items():
            found = [
                Endpoint(
                    f"http://{pod['status']['podIP']}:{ref.port}",
                    pod["metadata"].get("annotations", {}).get(PARITY_HASH_ANNOTATION),
                    slice=pod["metadata"].get("labels", {}).get(SLICE_LABEL),
                    kv_transport=pod["metadata"]
                    .get("annotations", {})
                    .get(KV_TRANSPORT_ANNOTATION),
                    kv_compat=pod["metadata"].get("annotations", {}).get(KV_COMPAT_ANNOTATION),
                    name=pod["metadata"]["name"],
                )
                for pod in self.pods.values()
                if matches(pod["metadata"].get("labels", {}), ref.selector) and pod_ready(pod)
            ]
            self.endpoints.replace(pool, sorted(found, key=lambda e: e.url))
        gateways = self.config.pools.gateway
        if self.peers is not None and gateways is not None:

            def url(pod: dict[str, Any]) -> str | None:
                """A ready gateway replica's URL, as its peers reach it."""
                if matches(pod["metadata"].get("labels", {}), gateways.selector) and pod_ready(pod):
                    return f"http://{pod['status']['podIP']}:{gateways.port}"
                return None

            own = self.pods.get(self.own_pod or "")
            self.peers.set_peers(
                [u for name, pod in self.pods.items() if name != self.own_pod and (u := url(pod))],
                # A replica takes part in electing the admission leader once its peers can see it.
                self_url=None if own is None else url(own),
            )

    async def list_pods(self) -> str:
        result = await self.kube._send(
            "GET", POD.collection(self.config.namespace), params={"labelSelector": self.selector}
        )
        assert result is not None
        self.pods = {p["metadata"]["name"]: p for p in result["items"]}
        self.publish()
        self.synced.set()
        return str(result["metadata"]["resourceVersion"])

    async def watch(self, resource_version: str) -> str:
        params = {
            "labelSelector": self.selector,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": "300",
        }
        async with self.kube.client.stream(
            "GET", POD.collection(self.config.namespace), params=params, timeout=None
        ) as response:
            if response.status_code != 200:
                raise KubeError(response)
            async for line in response.aiter_lines():
                if not line:
                    continue
                event = json.loads(line)
                kind, pod = event.get("type"), event.get("object", {})
                if kind == "ERROR":
                    return ""  # e.g. 410 Gone: re-list
                resource_version = pod.get("metadata", {}).get("resourceVersion", resource_version)
                if kind == "BOOKMARK":
                    continue
                name = pod["metadata"]["name"]
                if kind == "DELETED":
                    self.pods.pop(name, None)
                else:
                    self.pods[name] = pod
                self.publish()
        return resource_version

    async def run(self) -> None:
        """List, then watch from that version; re-list after errors, with capped backoff."""
        delay = 0.5
        version = ""
        while True:
            try:
                if not version:
                    version = await self.list_pods()
                version = await self.watch(version)
                delay = 0.5
            except (KubeError, httpx.HTTPError, json.JSONDecodeError) as error:
                log.warning("pod discovery: %s; retrying in %.1fs", error, delay)
                version = ""
                await asyncio.sleep(delay)  # backoff before re-listing, not synchronization
                delay = min(delay * 2, 30.0)
