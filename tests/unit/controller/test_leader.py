"""Leader election over one Lease: two electors against one store with the API server's
optimistic concurrency (resourceVersion, 409 Conflict), time driven by a fake clock."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import socket
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from pdserve.contract.names import LEADER_LEASE_NAME
from pdserve.controller import settings
from pdserve.controller.leader import LEADER_METRIC, LEASE, LeaderElector, parse_time
from pdserve.controller.settings import LeaderElectionSettings, add_arguments, from_arguments
from pdserve.kube.client import Kind, Kube, KubeError
from pdserve.kube.credentials import Credentials

NS = "pdserve-system"
START = datetime(2026, 1, 1, tzinfo=UTC)


class FakeClock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def conflict(path: str, method: str) -> KubeError:
    request = httpx.Request(method, f"https://api.test{path}")
    return KubeError(httpx.Response(409, json={"message": "conflict"}, request=request))


class FakeLeaseStore:
    """One Lease as the API server keeps it: every write bumps resourceVersion, a create of an
    existing Lease or a replace of a stale version answers 409. `before_write` runs just before
    a write lands (a racing replica's write); `down` makes every call fail like a lost API
    server."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.before_write: Callable[[], None] | None = None
        self.down = False
        self.writes = 0

    def _check(self) -> None:
        if self.down:
            raise httpx.ConnectError("API server unreachable")

    def _race(self) -> None:
        hook, self.before_write = self.before_write, None
        if hook is not None:
            hook()

    def store(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.writes += 1
        stored = copy.deepcopy(dict(obj))
        stored["metadata"] = {**stored["metadata"], "resourceVersion": str(self.version)}
        self.lease = stored
        return copy.deepcopy(stored)

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        self._check()
        assert (kind, namespace, name) == (LEASE, NS, LEADER_LEASE_NAME)
        return copy.deepcopy(self.lease)

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        self._check()
        self._race()
        if self.lease is not None:
            raise conflict("/leases", "POST")
        return self.store(obj)

    async def replace(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        self._check()
        self._race()
        assert self.lease is not None
        if obj["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise conflict("/leases/x", "PUT")
        return self.store(obj)

    @property
    def spec(self) -> dict[str, Any]:
        assert self.lease is not None
        spec: dict[str, Any] = self.lease["spec"]
        return spec


class Replica:
    """An elector and what it was told."""

    def __init__(self, store: Any, clock: FakeClock, identity: str, **options: Any) -> None:
        self.told: list[str] = []
        self.elector = LeaderElector(
            store, NS, identity, clock=clock, on_lead=lambda: self.told.append("lead"),
            on_lose=lambda: self.told.append("lose"), **options,
        )  # fmt: skip

    async def step(self) -> bool:
        return await self.elector.step()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store() -> FakeLeaseStore:
    return FakeLeaseStore()


async def test_of_two_replicas_only_one_leads(store: FakeLeaseStore, clock: FakeClock) -> None:
    a, b = Replica(store, clock, "pod-a"), Replica(store, clock, "pod-b")
    assert await a.step()
    assert not await b.step()
    clock.advance(5)
    assert await a.step()  # renewed
    assert not await b.step()
    assert (a.told, b.told) == (["lead"], [])
    assert store.spec["holderIdentity"] == "pod-a"
    assert store.spec["leaseDurationSeconds"] == 15
    assert store.spec["leaseTransitions"] == 0
    assert parse_time(store.spec["acquireTime"]) == START
    assert parse_time(store.spec["renewTime"]) == START + timedelta(seconds=5)


async def test_the_other_takes_over_only_after_the_lease_expires(
    store: FakeLeaseStore, clock: FakeClock
) -> None:
    a, b = Replica(store, clock, "pod-a"), Replica(store, clock, "pod-b")
    assert await a.step()
    clock.advance(15)  # renewTime + duration == now: not yet expired
    assert not await b.step()
    clock.advance(0.5)
    assert await b.step()
    assert b.told == ["lead"]
    assert store.spec["holderIdentity"] == "pod-b"
    assert store.spec["leaseTransitions"] == 1
    assert parse_time(store.spec["acquireTime"]) == clock.now
    # The old leader (say it was paused) finds the Lease taken and stops at once.
    assert not await a.step()
    assert a.told == ["lead", "lose"]
    assert not a.elector.leading


async def test_a_released_lease_is_taken_at_once(store: FakeLeaseStore, clock: FakeClock) -> None:
    a, b = Replica(store, clock, "pod-a"), Replica(store, clock, "pod-b")
    assert await a.step()
    assert not await b.step()
    await a.elector.release()
    assert store.spec["holderIdentity"] == ""
    assert not a.elector.leading
    assert await b.step()  # no clock advance: not a lease duration later
    assert store.spec["holderIdentity"] == "pod-b"
    assert store.spec["leaseTransitions"] == 1


async def test_a_follower_releases_nothing(store: FakeLeaseStore, clock: FakeClock) -> None:
    a, b = Replica(store, clock, "pod-a"), Replica(store, clock, "pod-b")
    assert await a.step()
    assert not await b.step()
    writes = store.writes
    await b.elector.release()
    assert store.writes == writes
    assert store.spec["holderIdentity"] == "pod-a"


async def test_the_loser_of_a_conflicting_takeover_does_not_lead(
    store: FakeLeaseStore, clock: FakeClock
) -> None:
    old, b = Replica(store, clock, "pod-old"), Replica(store, clock, "pod-b")
    assert await old.step()
    clock.advance(60)  # pod-old died: its Lease expired

    def a_wins() -> None:  # a read the same version and writes it first
        current = copy.deepcopy(store.lease)
        assert current is not None
        current["spec"]["holderIdentity"] = "pod-a"
        store.store(current)

    store.before_write = a_wins
    assert not await b.step()
    assert b.told == []
    assert store.spec["holderIdentity"] == "pod-a"


async def test_the_loser_of_a_racing_create_does_not_lead(
    store: FakeLeaseStore, clock: FakeClock
) -> None:
    a, b = Replica(store, clock, "pod-a"), Replica(store, clock, "pod-b")

    def a_creates_first() -> None:
        store.store(a.elector._lease(None, clock()))

    store.before_write = a_creates_first
    assert not await b.step()
    assert b.told == []
    assert store.spec["holderIdentity"] == "pod-a"


async def test_a_leader_whose_renewal_conflicts_steps_down(
    store: FakeLeaseStore, clock: FakeClock
) -> None:
    a, b = Replica(store, clock, "pod-a"), Replica(store, clock, "pod-b")
    assert await a.step()
    # Well within its renew deadline, another writer changed the Lease (a rival whose clock
    # runs ahead took it): a cannot tell it still leads, so it stops at once.
    clock.advance(5)

    def b_takes_over() -> None:
        current = copy.deepcopy(store.lease)
        assert current is not None
        store.store(b.elector._lease(current, clock()))

    store.before_write = b_takes_over
    assert not await a.step()
    assert a.told == ["lead", "lose"]


async def test_a_leader_that_cannot_renew_steps_down_before_the_lease_expires(
    store: FakeLeaseStore, clock: FakeClock
) -> None:
    a, b = Replica(store, clock, "pod-a"), Replica(store, clock, "pod-b")
    assert await a.step()
    store.down = True
    clock.advance(5)
    assert await a.step()  # one failed renewal: the Lease it wrote is still valid
    assert a.told == ["lead"]
    clock.advance(5)  # the renew deadline (two thirds of 15 s)
    assert not await a.step()
    assert a.told == ["lead", "lose"]
    # It stopped before anyone may take over: b cannot yet, even with the API back.
    store.down = False
    assert not await b.step()
    clock.advance(5.5)
    assert await b.step()
    assert not await a.step()
    assert a.told == ["lead", "lose"]  # told once


async def test_a_hung_lease_request_counts_as_a_failed_renewal(clock: FakeClock) -> None:
    class Hangs(FakeLeaseStore):
        hang = False

        async def get(self, kind: Kind, namespace: str | None, name: str) -> Any:
            if self.hang:
                await asyncio.Event().wait()  # never answers
            return await super().get(kind, namespace, name)

    store = Hangs()
    a = Replica(store, clock, "pod-a", request_seconds=0.01)
    assert await a.step()
    store.hang = True
    clock.advance(5)
    assert await a.step()  # given up on, and still within the renew deadline
    clock.advance(5)
    assert not await a.step()
    assert a.told == ["lead", "lose"]


async def test_the_gauge_follows_leadership(store: FakeLeaseStore, clock: FakeClock) -> None:
    registry = CollectorRegistry()
    a = Replica(store, clock, "pod-a", registry=registry)
    assert registry.get_sample_value(LEADER_METRIC) == 0
    assert await a.step()
    assert registry.get_sample_value(LEADER_METRIC) == 1
    await a.elector.release()
    assert registry.get_sample_value(LEADER_METRIC) == 0


class StopLoop(Exception):
    pass


async def test_the_loop_renews_every_third_polls_faster_and_survives_a_crash(
    store: FakeLeaseStore, clock: FakeClock
) -> None:
    sleeps: list[float] = []
    plan: list[Callable[[], None]] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock.advance(seconds)
        if not plan:
            raise StopLoop
        plan.pop(0)()

    class CrashesOnce(FakeLeaseStore):
        crash = True

        async def get(self, kind: Kind, namespace: str | None, name: str) -> Any:
            if self.crash:
                self.crash = False
                raise RuntimeError("a Lease of an unexpected shape")
            return await super().get(kind, namespace, name)

    crashing = CrashesOnce()
    a = Replica(crashing, clock, "pod-a", sleep=sleep)
    plan.extend([lambda: None, lambda: None])
    with pytest.raises(StopLoop):
        await a.elector.run()
    # Round 1 crashed (a follower retries in 2 s), then it led and renewed every 5 s.
    assert sleeps == [2.0, 5.0, 5.0]
    assert a.told == ["lead"]


async def test_an_empty_identity_is_refused(store: FakeLeaseStore) -> None:
    with pytest.raises(ValueError, match="identity"):
        LeaderElector(store, NS, "")


# ---- through the real client, against a fake Lease API ---------------------------------------
class LeaseAPI:
    """The coordination.k8s.io Lease endpoints as the API server answers them."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.requests: list[str] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.requests.append(f"{request.method} {path}")
        collection = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"
        item = f"{collection}/{LEADER_LEASE_NAME}"
        if request.method == "GET" and path == item:
            if self.lease is None:
                return httpx.Response(404, json={"message": "not found"})
            return httpx.Response(200, json=self.lease)
        body = json.loads(request.content)
        if request.method == "POST" and path == collection:
            if self.lease is not None:
                return httpx.Response(409, json={"message": "already exists"})
            return self._store(body, 201)
        if request.method == "PUT" and path == item:
            assert self.lease is not None
            if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
                return httpx.Response(409, json={"message": "the object has been modified"})
            return self._store(body, 200)
        return httpx.Response(405, json={"message": f"unexpected {request.method} {path}"})

    def _store(self, body: dict[str, Any], status: int) -> httpx.Response:
        self.version += 1
        body["metadata"]["resourceVersion"] = str(self.version)
        self.lease = body
        return httpx.Response(status, json=body)


def kube_for(api: LeaseAPI) -> Kube:
    kube = Kube(Credentials(server="https://api.test", token="t"))
    kube.client = httpx.AsyncClient(
        base_url="https://api.test", transport=httpx.MockTransport(api.handler)
    )
    return kube


async def test_electors_through_the_kube_client(clock: FakeClock) -> None:
    api = LeaseAPI()
    kube_a, kube_b = kube_for(api), kube_for(api)
    a, b = Replica(kube_a, clock, "pod-a"), Replica(kube_b, clock, "pod-b")
    assert await a.step()
    assert not await b.step()
    assert api.requests[:2] == [
        f"GET /apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{LEADER_LEASE_NAME}",
        f"POST /apis/coordination.k8s.io/v1/namespaces/{NS}/leases",
    ]
    assert api.lease is not None
    stale = copy.deepcopy(api.lease)
    await a.elector.release()
    assert await b.step()
    assert api.lease["spec"]["holderIdentity"] == "pod-b"
    # A write of the version read before the handover is refused with 409 Conflict.
    with pytest.raises(KubeError) as refused:
        await kube_a.replace(stale)
    assert refused.value.status == 409
    await kube_a.close()
    await kube_b.close()


# ---- settings ---------------------------------------------------------------------------------
def parse(argv: list[str], env: dict[str, str]) -> Any:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_arguments(parser.parse_args(argv), env)


ENV = {"PDSERVE_OPERATOR_NAMESPACE": NS, "POD_NAME": "pdserve-7d9f-abcde"}


def test_leader_election_is_off_unless_asked_for() -> None:
    assert parse([], ENV).leader_election is None
    assert parse(["--no-leader-election"], {**ENV, "PDSERVE_LEADER_ELECTION": "true"}) \
        .leader_election is None  # fmt: skip
    on = parse(["--leader-election"], ENV).leader_election
    assert on == LeaderElectionSettings(identity="pdserve-7d9f-abcde", lease_seconds=15.0)
    env = {**ENV, "PDSERVE_LEADER_ELECTION": "yes", "PDSERVE_LEADER_ELECTION_LEASE_SECONDS": "30"}
    from_env = parse([], env).leader_election
    assert from_env == LeaderElectionSettings(identity="pdserve-7d9f-abcde", lease_seconds=30.0)
    # Without POD_NAME the host name is the identity (a pod's host name is its name).
    hostname = parse(["--leader-election"], {"PDSERVE_OPERATOR_NAMESPACE": NS}).leader_election
    assert hostname is not None
    assert hostname.identity == socket.gethostname()


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        ([], {**ENV, "PDSERVE_LEADER_ELECTION": "maybe"}, "PDSERVE_LEADER_ELECTION"),
        (["--leader-election", "--leader-election-lease-seconds", "2"], ENV,
         "--leader-election-lease-seconds"),
        (["--leader-election"], {**ENV, "PDSERVE_LEADER_ELECTION_LEASE_SECONDS": "soon"},
         "PDSERVE_LEADER_ELECTION_LEASE_SECONDS"),
        (["--leader-election"], {"POD_NAME": "a", "PDSERVE_OPERATOR_NAMESPACE": ""},
         "PDSERVE_OPERATOR_NAMESPACE"),
    ],
)  # fmt: skip
def test_bad_leader_election_settings_name_the_setting(
    argv: list[str], env: dict[str, str], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not the service account's file either (a test may run in a pod): only the variable.
    monkeypatch.setattr(settings, "operator_namespace",
                        lambda env: env.get("PDSERVE_OPERATOR_NAMESPACE") or None)  # fmt: skip
    with pytest.raises(ValueError, match=named):
        parse(argv, env)
