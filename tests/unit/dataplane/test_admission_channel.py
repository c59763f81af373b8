"""The data plane's long prompts take fair-admission slots over one loopback connection: a slot
is granted as the gateway's own long requests get theirs (one long prefill per replica here),
goes back on release or when the connection closes, and a slot given up while still queued is
never granted to nobody. Only the data plane holding the token may ask."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from pdserve.gateway.dataplane_admission import AdmissionChannel
from pdserve.gateway.fairqueue import LONG, PrefillAdmission
from pdserve.gateway.peers import PeerAdmission

TOKEN = "t0ken"


@pytest.fixture
async def channel() -> AsyncIterator[tuple[AdmissionChannel, PrefillAdmission, str]]:
    admission = PrefillAdmission()  # one long prefill in flight per replica
    peers = PeerAdmission(admission, lambda: None)  # type: ignore[arg-type,return-value]
    served = AdmissionChannel(peers, TOKEN, hold_seconds=30)
    address = await served.start()
    yield served, admission, address
    await served.stop()


async def connect(
    address: str, token: str = TOKEN
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"hello {token}\n".encode())
    return reader, writer


async def line(reader: asyncio.StreamReader) -> str:
    return (await asyncio.wait_for(reader.readline(), 5)).decode().strip()


async def until(probe: Callable[[], bool], what: str) -> None:
    for _ in range(200):
        if probe():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_slots_are_granted_in_turn_and_given_back(
    channel: tuple[AdmissionChannel, PrefillAdmission, str],
) -> None:
    served, admission, address = channel
    reader, writer = await connect(address)
    writer.write(b"acquire 1 http://p0 http://p1\n")
    assert await line(reader) == "granted 1 http://p0"
    writer.write(b"acquire 2 http://p0\n")  # p0 is busy: queued
    writer.write(b"acquire 3 http://p1 http://p0\n")
    assert await line(reader) == "granted 3 http://p1"
    assert admission.long_in_flight == 2
    assert len(admission.queue) == 1
    writer.write(b"release 1\n")
    assert await line(reader) == "granted 2 http://p0"
    writer.write(b"release 2\nrelease 3\n")
    await until(lambda: admission.long_in_flight == 0 and served.held == 0, "all given back")
    writer.close()


async def test_a_slot_given_up_while_queued_is_never_granted(
    channel: tuple[AdmissionChannel, PrefillAdmission, str],
) -> None:
    _, admission, address = channel
    reader, writer = await connect(address)
    writer.write(b"acquire 1 http://p0\nacquire 2 http://p0\n")
    assert await line(reader) == "granted 1 http://p0"
    writer.write(b"release 2\n")  # its client left before a slot came
    await until(lambda: not admission.queue, "the waiter left the queue")
    writer.write(b"release 1\nacquire 3 http://p0\n")
    assert await line(reader) == "granted 3 http://p0"  # not 2
    writer.close()


async def test_a_closed_connection_gives_its_slots_back(
    channel: tuple[AdmissionChannel, PrefillAdmission, str],
) -> None:
    _, admission, address = channel
    reader, writer = await connect(address)
    writer.write(b"acquire 1 http://p0\nacquire 2 http://p0\n")
    assert await line(reader) == "granted 1 http://p0"
    writer.close()  # the data plane died: its prefills died with it
    await until(lambda: admission.long_in_flight == 0 and not admission.queue, "slots released")


async def test_only_the_data_plane_with_the_token_may_ask(
    channel: tuple[AdmissionChannel, PrefillAdmission, str],
) -> None:
    _, admission, address = channel
    reader, writer = await connect(address, token="guess")
    writer.write(b"acquire 1 http://p0\n")
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed without an answer
    assert admission.long_in_flight == 0


@pytest.fixture
async def remote() -> AsyncIterator[
    tuple[PrefillAdmission, asyncio.StreamReader, asyncio.StreamWriter]
]:
    """This replica's queue in the data plane: the test speaks the data plane's end."""
    admission = PrefillAdmission()
    peers = PeerAdmission(admission, lambda: None)  # type: ignore[arg-type,return-value]
    served = AdmissionChannel(peers, TOKEN, hold_seconds=30)
    admission.remote = served
    reader, writer = await connect(await served.start())
    await asyncio.wait_for(served.connected.wait(), 5)
    yield admission, reader, writer
    writer.close()
    await served.stop()


async def test_the_gateways_own_long_requests_are_asked_for_in_the_data_planes_queue(
    remote: tuple[PrefillAdmission, asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    admission, reader, writer = remote
    async with contextlib.AsyncExitStack() as stack:
        held = asyncio.create_task(stack.enter_async_context(
            admission.admit(LONG, ["http://p0", "http://p1"])))  # fmt: skip
        assert await line(reader) == "acquire 1 http://p0 http://p1"
        assert not held.done()  # waits for the data plane's grant
        writer.write(b"granted 1 http://p1\n")
        assert await asyncio.wait_for(held, 5) == "http://p1"
        assert admission.long_in_flight == 0  # counted where the queue runs, not here
    assert await line(reader) == "release 1"


async def test_a_request_that_leaves_while_queued_in_the_data_plane_is_released_there(
    remote: tuple[PrefillAdmission, asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    admission, reader, _ = remote

    async def hold() -> None:
        async with admission.admit(LONG, ["http://p0"]):
            raise AssertionError("never granted")

    waiting = asyncio.create_task(hold())
    assert await line(reader) == "acquire 1 http://p0"
    waiting.cancel()  # its client left
    assert await line(reader) == "release 1"


async def test_without_its_data_plane_a_waiting_request_goes_on_its_first_choice(
    remote: tuple[PrefillAdmission, asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    admission, reader, writer = remote

    async def hold() -> str | None:
        async with admission.admit(LONG, ["http://p0", "http://p1"]) as granted:
            return granted

    waiting = asyncio.create_task(hold())
    assert await line(reader) == "acquire 1 http://p0 http://p1"
    writer.close()  # the data plane died (this gateway stops with it): nothing to wait in
    assert await asyncio.wait_for(waiting, 5) == "http://p0"
