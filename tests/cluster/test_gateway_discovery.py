"""The gateway's pod discovery on the real control plane: ready pods of each pool become
endpoints with their parity hash; unready and deleted pods drop out (watch, not polling)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from devtools.localplane import ControlPlane
from pdserve.api import parse_resource
from pdserve.builders import routing_config
from pdserve.contract.names import PARITY_HASH_ANNOTATION
from pdserve.gateway.discovery import PodDiscovery
from pdserve.gateway.endpoints import Endpoints
from pdserve.gateway.fairqueue import PrefillAdmission
from pdserve.gateway.peers import PeerAdmission
from pdserve.kube.client import Kube
from pdserve.kube.credentials import load_credentials

pytestmark = pytest.mark.cluster


def pod(name: str, component: str, parity: str, *, ready: bool = True) -> dict[str, Any]:
    annotations = {PARITY_HASH_ANNOTATION: parity}
    if not ready:
        annotations["pdserve.io/kwok-ready"] = "false"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "annotations": annotations,
            "labels": {
                "app.kubernetes.io/instance": "m",
                "app.kubernetes.io/component": component,
                "app.kubernetes.io/managed-by": "pdserve",
            },
        },
        "spec": {"containers": [{"name": "c", "image": "sim"}]},
    }


async def wait_for(condition: Any, deadline_seconds: float = 30) -> None:
    async def poll() -> None:
        while not condition():  # noqa: ASYNC110 - the watch task updates the state
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), deadline_seconds)


async def test_ready_pods_become_endpoints_with_their_parity_hash(
    control_plane: ControlPlane, http_api: httpx.Client, namespace: str
) -> None:
    dm = parse_resource(
        {
            "metadata": {"name": "m", "namespace": namespace},
            "spec": {"model": {"name": "org/model"}, "prefill": {}},
        }
    )
    config = routing_config(dm, "hash-new")
    endpoints = Endpoints(config)
    kube = Kube(load_credentials(str(control_plane.kubeconfig())))
    peers = PeerAdmission(PrefillAdmission(), lambda: None)  # type: ignore[arg-type,return-value]
    discovery = PodDiscovery(kube, config, endpoints, peers, own_pod="gateway-self")
    task = asyncio.create_task(discovery.run())
    try:
        for body in (
            pod("render-0", "render", "hash-new"),
            pod("prefill-0", "prefill", "hash-old"),
            pod("decode-0", "decode", "hash-new"),
            pod("decode-1", "decode", "hash-new", ready=False),
            pod("gateway-self", "gateway", "hash-new"),
            pod("gateway-peer", "gateway", "hash-new"),
        ):
            created = await asyncio.to_thread(
                http_api.post, f"/api/v1/namespaces/{namespace}/pods", json=body
            )
            created.raise_for_status()

        def pools_filled() -> bool:
            return all(endpoints.pools[p] for p in ("render", "prefill", "decode"))

        await wait_for(pools_filled)
        # The other gateway replica shares the long-prefill limit; this one is not its own peer.
        await wait_for(lambda: len(peers.urls) == 1)
        [peer_pod] = [p for p in discovery.pods.values() if p["metadata"]["name"] == "gateway-peer"]
        assert peers.urls == [f"http://{peer_pod['status']['podIP']}:8000"]
        # Its own ready pod is its address in electing the admission leader.
        await wait_for(lambda: peers.self_url is not None)
        own_pod = discovery.pods["gateway-self"]
        assert peers.self_url == f"http://{own_pod['status']['podIP']}:8000"
        assert [e.parity_hash for e in endpoints.pools["decode"]] == [
            "hash-new"
        ]  # decode-1 unready
        assert [e.parity_hash for e in endpoints.pools["prefill"]] == ["hash-old"]
        assert all(
            e.url.startswith("http://10.0.0.") and e.url.endswith(":8000")
            for p in endpoints.pools.values()
            for e in p
        )
        # The old prefill pod cannot pair with the new render/decode: P/D waits, the rest serves.
        selection = endpoints.select(["render", "decode"], optional=["prefill"])
        assert selection.parity_hash == "hash-new"
        assert selection.pools["prefill"] == []

        # The operator's transport verdict and the slice label reach the endpoint live.
        patch = {"metadata": {"labels": {"pdserve.io/slice": "1"},
                              "annotations": {"pdserve.io/kv-transport": "Verified"}}}  # fmt: skip
        patched = await asyncio.to_thread(
            http_api.patch, f"/api/v1/namespaces/{namespace}/pods/prefill-0", json=patch,
            headers={"Content-Type": "application/merge-patch+json"},
        )  # fmt: skip
        patched.raise_for_status()
        [prefill] = endpoints.pools["prefill"]
        await wait_for(lambda: (prefill.slice, prefill.kv_transport) == ("1", "Verified"))

        deleted = await asyncio.to_thread(
            http_api.delete, f"/api/v1/namespaces/{namespace}/pods/decode-0"
        )
        deleted.raise_for_status()
        await wait_for(lambda: not endpoints.pools["decode"])
    finally:
        task.cancel()
        await kube.close()
