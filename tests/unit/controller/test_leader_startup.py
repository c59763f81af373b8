"""The kopf startup and cleanup handlers with leader election on: the replica takes the Lease
through the real client and reconciles, and cleanup releases the Lease for the next replica."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import kopf
import pytest

from pdserve.controller import handlers
from pdserve.controller.settings import LeaderElectionSettings, OperatorSettings
from pdserve.kube.client import Kube
from pdserve.kube.credentials import Credentials
from tests.unit.controller.test_leader import NS, LeaseAPI


def handler_named(registry: kopf.OperatorRegistry, name: str) -> Any:
    handlers_ = registry._activities.get_all_handlers()
    [found] = [h.fn for h in handlers_ if getattr(h.fn, "__name__", "") == name]
    return found


async def test_startup_elects_and_cleanup_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    api = LeaseAPI()

    def handler(request: httpx.Request) -> httpx.Response:
        if "/leases" in request.url.path:
            return api.handler(request)
        api.requests.append(f"{request.method} {request.url.path}")
        return httpx.Response(200, json={"items": []})  # no models to list

    def fake_kube(credentials: Credentials) -> Kube:
        kube = Kube(credentials)
        kube.client = httpx.AsyncClient(
            base_url="https://api.test", transport=httpx.MockTransport(handler)
        )
        return kube

    monkeypatch.setattr(handlers, "Kube", fake_kube)
    settings = OperatorSettings(
        operator_namespace=NS, engine_metrics_seconds=0, autoscale_seconds=0,
        leader_election=LeaderElectionSettings(identity="pdserve-abc"),
    )  # fmt: skip
    registry, running = handlers.build_registry(
        Credentials(server="https://api.test", token="t"), settings
    )
    await handler_named(registry, "startup")(settings=kopf.OperatorSettings())
    reconciler = running.started()
    deadline = asyncio.get_running_loop().time() + 5
    while not reconciler.leading:  # the election loop's first round, polled with a deadline
        assert asyncio.get_running_loop().time() < deadline, api.requests
        await asyncio.sleep(0.01)
    assert api.lease is not None
    assert api.lease["spec"]["holderIdentity"] == "pdserve-abc"
    assert [t.get_name() for t in reconciler._loops] == ["resync"]
    await handler_named(registry, "cleanup")()
    assert api.lease["spec"]["holderIdentity"] == ""
    assert not reconciler.leading
    assert reconciler._loops == []
    assert running.election is not None
    assert running.election.cancelled()
    # The new leader listed every model (cluster-wide: no namespaces configured).
    assert "GET /apis/pdserve.io/v1alpha1/disaggregatedmodels" in api.requests
