"""The Reconciler under leader election: a follower remembers models but writes nothing; a new
leader reconciles every model it can list and starts its loops; a leader that loses the Lease
stops its loops and its in-flight passes before they write again; shutdown releases the Lease."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from pdserve.controller import runner
from pdserve.controller.handlers import Running, shut_down
from pdserve.controller.leader import LeaderElector
from pdserve.controller.reconcile import Outcome
from pdserve.controller.runner import Reconciler
from pdserve.controller.settings import OperatorSettings
from pdserve.kube.client import Kube
from tests.support.fakekube import NAME, NS, FakeKube, model_in
from tests.unit.controller.test_leader import FakeClock, FakeLeaseStore

QUIET = OperatorSettings(resync_seconds=3600, engine_metrics_seconds=0, autoscale_seconds=0)


def add_model(kube: FakeKube, namespace: str, name: str) -> None:
    model_in(kube)
    body = kube.objects.pop(("DisaggregatedModel", NS, NAME))
    body["metadata"].update(namespace=namespace, name=name)
    kube.put(body)


async def test_a_follower_remembers_models_but_writes_nothing() -> None:
    kube = FakeKube()
    model_in(kube)
    reconciler = Reconciler(cast(Kube, kube), QUIET, leading=False)
    reconciler.trigger(NS, NAME)
    await reconciler.drain()
    assert reconciler.known == {(NS, NAME)}
    assert kube.writes == []
    assert kube.reads == []  # not even read: the leader does the passes

    # The same model with a leading Reconciler: the pass does write (so the check above can
    # fail).
    leader = Reconciler(cast(Kube, kube), QUIET)
    leader.trigger(NS, NAME)
    await leader.drain()
    assert any(w.startswith("apply ") for w in kube.writes)


async def test_a_new_leader_reconciles_every_listed_model_and_starts_its_loops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    passes: list[tuple[str, str]] = []

    async def records(_kube: Any, body: dict[str, Any], **_: Any) -> Outcome:
        passes.append((body["metadata"]["namespace"], body["metadata"]["name"]))
        return Outcome()

    monkeypatch.setattr(runner, "reconcile", records)
    kube = FakeKube()
    for namespace, name in (("team-a", "one"), ("team-b", "two"), ("team-b", "three")):
        add_model(kube, namespace, name)
    reconciler = Reconciler(cast(Kube, kube), QUIET, leading=False)
    reconciler.trigger("team-a", "one")  # heard of while following
    await reconciler.drain()
    assert passes == []
    assert reconciler._loops == []
    reconciler.lead()
    await reconciler.drain()
    # Every model, the two it never heard of included (it may have missed their events).
    assert sorted(passes) == [("team-a", "one"), ("team-b", "three"), ("team-b", "two")]
    assert "list DisaggregatedModel " in kube.reads  # cluster-wide
    assert [t.get_name() for t in reconciler._loops] == ["resync"]
    reconciler.step_down()
    await reconciler.close()


async def test_a_new_leader_watching_namespaces_lists_only_those(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    passes: list[tuple[str, str]] = []

    async def records(_kube: Any, body: dict[str, Any], **_: Any) -> Outcome:
        passes.append((body["metadata"]["namespace"], body["metadata"]["name"]))
        return Outcome()

    monkeypatch.setattr(runner, "reconcile", records)
    kube = FakeKube()
    add_model(kube, "team-a", "one")
    add_model(kube, "team-b", "two")
    settings = OperatorSettings(namespaces=("team-a",), resync_seconds=3600,
                                engine_metrics_seconds=0, autoscale_seconds=0)  # fmt: skip
    reconciler = Reconciler(cast(Kube, kube), settings, leading=False)
    reconciler.lead()
    await reconciler.drain()
    assert passes == [("team-a", "one")]
    assert [r for r in kube.reads if r.startswith("list")] == ["list DisaggregatedModel team-a"]
    reconciler.step_down()
    await reconciler.close()


async def test_losing_the_lease_stops_loops_and_in_flight_passes_before_they_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started = asyncio.Event()
    proceed = asyncio.Event()
    written: list[str] = []

    async def slow_pass(kube: Any, body: dict[str, Any], **_: Any) -> Outcome:
        started.set()
        await proceed.wait()  # the pass is mid-way (waiting on the API server) when it loses
        written.append(body["metadata"]["name"])
        return Outcome()

    monkeypatch.setattr(runner, "reconcile", slow_pass)
    kube = FakeKube()
    model_in(kube)
    reconciler = Reconciler(cast(Kube, kube), QUIET)
    reconciler.start_loops()
    loops = list(reconciler._loops)
    reconciler.trigger(NS, NAME)
    await asyncio.wait_for(started.wait(), timeout=5)
    reconciler.step_down()
    proceed.set()
    await reconciler.drain()
    await asyncio.gather(*loops, return_exceptions=True)
    assert written == []
    assert all(t.cancelled() for t in loops)
    assert reconciler._loops == []
    # Events keep arriving after it stepped down: remembered, not reconciled.
    reconciler.trigger(NS, "another")
    await reconciler.drain()
    assert written == []
    assert reconciler.known == {(NS, NAME), (NS, "another")}
    await reconciler.close()


async def test_leadership_follows_the_lease_and_shutdown_releases_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    passes: list[str] = []

    async def records(_kube: Any, body: dict[str, Any], **_: Any) -> Outcome:
        passes.append(body["metadata"]["name"])
        return Outcome()

    monkeypatch.setattr(runner, "reconcile", records)
    kube, store, clock = FakeKube(), FakeLeaseStore(), FakeClock()
    model_in(kube)
    reconciler = Reconciler(cast(Kube, kube), QUIET, leading=False)
    elector = LeaderElector(store, "pdserve-system", "pod-a", clock=clock,
                            on_lead=reconciler.lead, on_lose=reconciler.step_down)  # fmt: skip
    assert await elector.step()
    assert reconciler.leading
    await reconciler.drain()
    assert passes == [NAME]
    # Another replica took the expired Lease: this one stops reconciling.
    clock.advance(30)
    rival = LeaderElector(store, "pdserve-system", "pod-b", clock=clock)
    assert await rival.step()
    assert not await elector.step()
    assert not reconciler.leading
    reconciler.trigger(NS, NAME)
    await reconciler.drain()
    assert passes == [NAME]
    # It leads again after the rival released; shutdown then hands the Lease back.
    await rival.release()
    assert await elector.step()
    await reconciler.drain()
    assert passes == [NAME, NAME]
    await shut_down(Running(reconciler=reconciler, elector=elector))
    assert store.spec["holderIdentity"] == ""
    assert not reconciler.leading
    assert kube.closed
