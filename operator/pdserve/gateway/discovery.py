"""In-cluster discovery: list and watch the model's Pods (namespace-scoped RBAC) and keep every
pool's endpoints current: ready pods only (a multi-node group's only while the whole group is),
addressed by pod IP, each with its parity hash (and, engines, its KV-compatibility digest)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

from pdserve.contract.groups import group_of, whole_groups
from pdserve.contract.names import (
    KV_COMPAT_ANNOTATION,
    KV_TRANSPORT_ANNOTATION,
    PARITY_HASH_ANNOTATION,
    SLICE_LABEL,
)
from pdserve.contract.routing import GatewayConfig, PoolRef
from pdserve.gateway.endpoints import Endpoint, Endpoints, rank_targets
from pdserve.gateway.peers import PeerAdmission
from pdserve.kube.client import KINDS, Kube
from pdserve.kube.informer import Informer

POD = KINDS[("v1", "Pod")]


def pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status", {})
    if pod.get("metadata", {}).get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", [])
    )


def routable(pods: Iterable[Mapping[str, Any]]) -> set[str]:
    """The names of the Ready pods requests may go to: a pod of a LeaderWorkerSet group only
    while every pod of its group is Ready (pdserve.contract.groups), every other Ready pod."""
    listed = list(pods)
    whole = whole_groups(listed, pod_ready)
    return {
        p["metadata"]["name"] for p in listed
        if pod_ready(p) and (group_of(p) is None or group_of(p) in whole)
    }  # fmt: skip


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
        self.informer = Informer(
            kube, POD, config.namespace, label_selector=self.selector, on_change=self._changed,
            on_listed=self._listed,
        )  # fmt: skip

    def publish(self) -> None:
        to = routable(self.pods.values())
        for pool, ref in self.pools.items():
            found = [
                target
                for pod in self.pods.values()
                if matches(pod["metadata"].get("labels", {}), ref.selector)
                and pod["metadata"]["name"] in to
                for target in rank_targets(self.endpoint_of(pod, ref), ref.data_parallel_local)
            ]
            self.endpoints.replace(pool, sorted(found, key=lambda e: (e.url, e.rank or 0)))
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

    @staticmethod
    def endpoint_of(pod: Mapping[str, Any], ref: PoolRef) -> Endpoint:
        """A Ready pod of a pool, addressed by its IP, with what its annotations say."""
        annotations = pod["metadata"].get("annotations", {})
        return Endpoint(
            f"http://{pod['status']['podIP']}:{ref.port}",
            annotations.get(PARITY_HASH_ANNOTATION),
            slice=pod["metadata"].get("labels", {}).get(SLICE_LABEL),
            kv_transport=annotations.get(KV_TRANSPORT_ANNOTATION),
            kv_compat=annotations.get(KV_COMPAT_ANNOTATION),
            name=pod["metadata"]["name"],
        )

    def _changed(self, event: str, pod: Mapping[str, Any]) -> None:
        name = pod["metadata"]["name"]
        if event == "DELETED":
            self.pods.pop(name, None)
        else:
            self.pods[name] = dict(pod)
        self.publish()

    def _listed(self) -> None:
        self.pods = {p["metadata"]["name"]: p for p in self.informer.objects.values()}
        self.publish()
        self.synced.set()

    async def run(self) -> None:
        """List, then watch from that version; re-list after errors, with capped backoff."""
        await self.informer.run()
