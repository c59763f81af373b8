"""Fair admission in front of prefill: shorts overtake, longs are limited per replica and
first come first served, and aging bounds every wait."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.gateway.fairqueue import FairQueueSettings, PrefillAdmission


def admission(**settings: float) -> PrefillAdmission:
    return PrefillAdmission(FairQueueSettings(**settings))  # type: ignore[arg-type]


def test_classes_come_from_length_or_the_declared_class() -> None:
    gate = admission(long_prompt_tokens=1000)
    assert gate.request_class(5000, None) == "long"
    assert gate.request_class(10, None) == "short"
    assert gate.request_class(10, "document") == "long"
    assert gate.request_class(5000, "chat") == "short"


async def test_short_requests_overtake_a_full_long_queue() -> None:
    gate = admission(max_long_per_replica=1)
    async with gate.admit("long", replicas=["a"]):
        waiting = asyncio.create_task(_hold(gate, "long"))
        await _until(lambda: len(gate.queue) == 1)
        async with gate.admit("short", replicas=["a"]):
            assert len(gate.queue) == 1  # the short one went ahead
    await waiting
    assert gate.long_in_flight == 0


async def test_longs_wait_their_turn_in_order() -> None:
    gate = admission(max_long_per_replica=1)
    order: list[int] = []
    async with gate.admit("long", replicas=["a"]):
        tasks = [asyncio.create_task(_hold(gate, "long", order, n)) for n in range(3)]
        await _until(lambda: len(gate.queue) == 3)
        assert gate.long_in_flight == 1
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]


async def test_each_replica_takes_its_own_long_prefills_in_order_of_preference() -> None:
    gate = admission(max_long_per_replica=1)
    async with gate.admit("long", ["a", "b"]) as first, gate.admit("long", ["a", "b"]) as second:
        assert (first, second) == ("a", "b")  # a is full: the second goes to b, not to a
        assert gate.in_flight == {"a": 1, "b": 1}
        assert not gate.queue
        waiting = asyncio.create_task(_granted(gate, ["b", "a"]))
        await _until(lambda: len(gate.queue) == 1)
    assert await waiting == "b"  # both freed at once: its first choice
    assert gate.long_in_flight == 0


async def test_a_request_for_a_busy_replica_does_not_hold_back_one_for_a_free_replica() -> None:
    gate = admission(max_long_per_replica=1)
    async with gate.admit("long", ["a"]):
        blocked = asyncio.create_task(_granted(gate, ["a"]))
        await _until(lambda: len(gate.queue) == 1)
        async with gate.admit("long", ["a", "b"]) as replica:
            assert replica == "b"
            assert not blocked.done()
    assert await blocked == "a"


async def test_replicas_held_by_peers_count_against_the_limit() -> None:
    gate = admission(max_long_per_replica=1)
    gate.others = lambda replica: 1 if replica == "a" else 0
    async with gate.admit("long", ["a", "b"]) as replica:
        assert replica == "b"


async def test_aging_admits_a_long_request_after_the_bound() -> None:
    gate = admission(max_long_per_replica=1, max_wait_seconds=0.05)
    async with gate.admit("long", replicas=["a"]):
        await asyncio.wait_for(_hold(gate, "long"), timeout=2)  # admitted although the slot is busy
    assert gate.aged == 1
    assert gate.long_in_flight == 0


async def test_a_cancelled_waiter_gives_up_its_place() -> None:
    gate = admission(max_long_per_replica=1)
    async with gate.admit("long", replicas=["a"]):
        waiting = asyncio.create_task(_hold(gate, "long"))
        await _until(lambda: len(gate.queue) == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not gate.queue
    assert gate.long_in_flight == 0


async def test_a_release_asks_the_peers_count_once_per_replica_however_long_the_queue() -> None:
    """The peers' counts are summed over every peer's state: asking them once per waiter made
    each release with 128 long prompts queued cost the gateway about a millisecond."""
    gate = admission(max_long_per_replica=1)
    asked: list[str] = []

    def others(replica: str) -> int:
        asked.append(replica)
        return 0

    gate.others = others
    order: list[int] = []
    async with gate.admit("long", replicas=["a"]):
        tasks = [asyncio.create_task(_hold(gate, "long", order, n)) for n in range(50)]
        await _until(lambda: len(gate.queue) == 50)
        asked.clear()
    await asyncio.gather(*tasks)
    assert order == list(range(50))  # still first come first served
    # One pass per release (51) and per arrival, each asking about "a" once.
    assert asked.count("a") <= 2 * 51, len(asked)
    assert gate.long_in_flight == 0
    assert not gate.queue


async def _hold(
    gate: PrefillAdmission, kind: str, order: list[int] | None = None, n: int = 0
) -> None:
    async with gate.admit(kind, replicas=["a"]):
        if order is not None:
            order.append(n)


async def _granted(gate: PrefillAdmission, replicas: list[str]) -> str | None:
    async with gate.admit("long", replicas) as replica:
        return replica


async def _until(condition: object) -> None:
    async def poll() -> None:
        while not condition():  # type: ignore[operator]  # noqa: ASYNC110
            await asyncio.sleep(0)

    await asyncio.wait_for(poll(), timeout=2)


def test_the_lowest_url_among_replicas_that_see_each_other_leads_admission() -> None:
    from pdserve.gateway.peers import PeerAdmission

    peers = PeerAdmission(admission(), lambda: None)  # type: ignore[arg-type,return-value]
    peers.set_peers(["http://10.0.0.3:8000", "http://10.0.0.1:8000"], "http://10.0.0.2:8000")
    assert peers.leader() is None  # no peer has answered yet: admit here
    peers.live = {"http://10.0.0.3:8000"}
    assert peers.leader() is None  # this replica sorts lowest of those alive
    peers.live = {"http://10.0.0.3:8000", "http://10.0.0.1:8000"}
    assert peers.leader() == "http://10.0.0.1:8000"
    peers.set_peers(["http://10.0.0.3:8000"], "http://10.0.0.2:8000")  # .1 left the model
    assert peers.leader() is None
    peers.set_peers(["http://10.0.0.1:8000"], None)
    peers.live = {"http://10.0.0.1:8000"}
    assert peers.leader() is None  # without its own address a replica cannot follow anyone


def test_slots_held_through_a_leader_that_is_gone_still_count() -> None:
    """A leader's report covers the slots its followers hold through it; when it stops
    answering, those prefills still run, so the followers' own reports of them count."""
    from collections import Counter

    from pdserve.gateway.peers import PeerAdmission, PeerState

    leader, follower = "http://10.0.0.1:8000", "http://10.0.0.3:8000"
    peers = PeerAdmission(admission(), lambda: None)  # type: ignore[arg-type,return-value]
    peers.set_peers([leader, follower], "http://10.0.0.2:8000")
    peers.live = {leader, follower}
    peers.states = {  # the leader's own count covers both holds
        leader: PeerState({"p0": 2}, {}, 0),
        follower: PeerState({}, {leader: {"p0": 1}}, 0),
    }
    peers.held = {leader: Counter({"p0": 1})}  # this replica holds the other one
    assert peers.total("p0") == 2
    peers.live = {follower}  # the leader died; the prefills it granted did not
    peers.states = {leader: PeerState({}, {}, 0), follower: PeerState({}, {leader: {"p0": 1}}, 0)}
    assert peers.total("p0") == 2
    assert peers.total("p1") == 0
    state = PeerState.parse({"replicas": {"p0": 1}, "heldAt": {leader: {"p0": 1}}, "queued": 2})
    assert (state.replicas, state.held_at, state.queued) == ({"p0": 1}, {leader: {"p0": 1}}, 2)
