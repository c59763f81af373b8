"""Behind the data plane, this gateway replica's fair prefill queue runs in the data plane (the
real binary here): the gateway's own long requests wait in it over the admission channel, first
come first served, one long prefill per replica, counting what the peers hold; a request whose
client left while it waited is never granted; and the queue's state comes back in /stats as
`GET /admission` reports it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.gateway.dataplane import build_binary
from pdserve.gateway.dataplane_admission import AdmissionChannel
from pdserve.gateway.fairqueue import LONG, FairQueueSettings, PrefillAdmission
from pdserve.gateway.peers import PeerAdmission

TOKEN = "t0ken"
CONTROL = {"Authorization": f"Bearer {TOKEN}"}  # the control API answers only its token


@pytest.fixture(scope="module")
def binary() -> Path:
    return build_binary()


@dataclass
class Plane:
    admission: PrefillAdmission
    channel: AdmissionChannel
    control: str
    version: int = 0

    async def table(self, others: dict[str, int] | None = None) -> None:
        """Push a routing table with no models: only how the queue runs."""
        self.version += 1
        table = {
            "version": self.version,
            "models": {},
            "admission": {"maxLongPerReplica": 1, "maxWaitSeconds": 60,
                          "leaderElsewhere": False, "others": others or {}},
        }  # fmt: skip
        async with httpx.AsyncClient(headers=CONTROL) as client:
            answer = await client.put(f"{self.control}/table", json=table)
        assert answer.status_code == 204, answer.text

    async def stats(self) -> dict[str, Any]:
        async with httpx.AsyncClient(headers=CONTROL) as client:
            stats: dict[str, Any] = (await client.get(f"{self.control}/stats")).json()
        self.channel.fold_state(stats)
        return stats

    async def until(self, probe: Callable[[dict[str, Any]], bool], what: str) -> None:
        for _ in range(500):
            if probe((await self.stats())["admission"]):
                return
            await asyncio.sleep(0.01)  # polling the data plane's counters, with a deadline
        raise AssertionError(f"{what}: {(await self.stats())['admission']}")


@pytest.fixture
async def plane(binary: Path) -> AsyncIterator[Plane]:
    admission = PrefillAdmission(FairQueueSettings(max_wait_seconds=60))
    peers = PeerAdmission(admission, lambda: None)  # type: ignore[arg-type,return-value]
    channel = AdmissionChannel(peers, TOKEN, hold_seconds=60)
    admission.remote = channel
    address = await channel.start()
    process = await asyncio.create_subprocess_exec(
        str(binary), "-listen", "127.0.0.1:0", "-python", "http://127.0.0.1:9",
        "-control", "127.0.0.1:0", "-admission", address, "-exit-with-stdin",
        "-latency-buckets", "0.1,1", "-count-buckets", "1,2",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PDSERVE_DATAPLANE_TOKEN": TOKEN},
    )  # fmt: skip
    assert process.stdout is not None
    try:
        started = json.loads(await asyncio.wait_for(process.stdout.readline(), 30))
        await asyncio.wait_for(channel.connected.wait(), 30)
        each = Plane(admission, channel, "http://" + started["control"])
        await each.table()
        yield each
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        await channel.stop()


async def granted(admission: PrefillAdmission, replicas: list[str], release: asyncio.Event) -> str:
    async with admission.admit(LONG, replicas) as replica:
        assert replica is not None
        await release.wait()
        return replica


async def test_the_gateways_long_requests_wait_their_turn_in_the_data_planes_queue(
    plane: Plane,
) -> None:
    admission = plane.admission
    done = asyncio.Event()
    async with admission.admit(LONG, ["http://p0", "http://p1"]) as first:
        assert first == "http://p0"
        second = asyncio.create_task(granted(admission, ["http://p0"], done))
        await plane.until(lambda queue: queue["queued"] == 1, "the second waits for p0")
        # A later request that may use the free p1 does not wait behind it.
        async with admission.admit(LONG, ["http://p0", "http://p1"]) as third:
            assert third == "http://p1"
            await plane.until(
                lambda queue: queue["replicas"] == {"http://p0": 1, "http://p1": 1},
                "both replicas' slots held",
            )
            state = admission.state()  # what GET /admission and the metrics report
            assert (state.long_in_flight, state.queued) == (2, 1)
            assert not second.done()
    done.set()
    assert await asyncio.wait_for(second, 10) == "http://p0"  # p0 went back: the second's turn
    await plane.until(lambda queue: not queue["replicas"], "every slot given back")


async def test_a_request_that_leaves_while_queued_is_never_granted(plane: Plane) -> None:
    admission = plane.admission
    done = asyncio.Event()
    holder = asyncio.create_task(granted(admission, ["http://p0"], done))
    await plane.until(lambda queue: queue["replicas"] == {"http://p0": 1}, "p0 held")
    leaving = asyncio.create_task(granted(admission, ["http://p0"], done))
    await plane.until(lambda queue: queue["queued"] == 1, "the second queued")
    leaving.cancel()  # its client left
    await plane.until(lambda queue: queue["queued"] == 0, "it left the queue")
    done.set()
    assert await asyncio.wait_for(holder, 10) == "http://p0"
    await plane.until(lambda queue: not queue["replicas"], "p0 free (never granted to it)")


async def test_long_prefills_the_peers_hold_count_against_the_limit(plane: Plane) -> None:
    await plane.table(others={"http://p0": 1})  # a peer holds p0's one slot on its own
    done = asyncio.Event()
    done.set()
    waiting = asyncio.create_task(granted(plane.admission, ["http://p0"], done))
    await plane.until(lambda queue: queue["queued"] == 1, "p0 is full with the peer's prefill")
    await plane.table(others={})  # the peer's prefill ended
    assert await asyncio.wait_for(waiting, 10) == "http://p0"
