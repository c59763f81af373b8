"""The Reconciler owns its background loops (resync, transport health, Builtin autoscaling) so
the kopf handlers only start and stop it."""

from __future__ import annotations

import asyncio
from typing import cast

from pdserve.controller.runner import Reconciler
from pdserve.controller.settings import OperatorSettings
from pdserve.kube.client import Kube
from tests.support.fakekube import FakeKube


async def test_the_reconciler_starts_stops_and_closes_its_loops() -> None:
    kube = FakeKube()
    settings = OperatorSettings(resync_seconds=3600, engine_metrics_seconds=3600,
                                autoscale_seconds=3600)  # fmt: skip
    reconciler = Reconciler(cast(Kube, kube), settings)
    reconciler.start_loops()
    loops = list(reconciler._loops)
    assert sorted(t.get_name() for t in loops) == ["autoscale", "resync", "transport health"]
    await asyncio.sleep(0)
    reconciler.stop_loops()
    await asyncio.gather(*loops, return_exceptions=True)
    assert all(t.cancelled() for t in loops)
    await reconciler.close()
    assert kube.closed
    assert reconciler.health is not None
    assert reconciler.health.client.is_closed
    assert reconciler.autoscaler is not None
    assert reconciler.autoscaler.client.is_closed


async def test_switched_off_scrapers_have_no_loop() -> None:
    settings = OperatorSettings(resync_seconds=3600, engine_metrics_seconds=0,
                                autoscale_seconds=0)  # fmt: skip
    reconciler = Reconciler(cast(Kube, FakeKube()), settings)
    reconciler.start_loops()
    assert [t.get_name() for t in reconciler._loops] == ["resync"]
    reconciler.stop_loops()
    await reconciler.close()
