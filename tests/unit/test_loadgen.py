"""The one load generator: open loop at offsets or all at once, closed loop with N clients until
the items or a deadline run out, the in-flight cap, a stop event, and a failing send."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from pdserve.loadgen import Clock, drive


async def test_open_loop_sends_each_item_at_its_offset_on_a_scaled_clock() -> None:
    clock = Clock(0.5)  # half a real second per simulated second
    sent: dict[int, float] = {}

    async def send(item: int) -> None:
        sent[item] = clock.elapsed()

    offsets = {0: 0.0, 1: 0.1, 2: 0.2}
    interrupted = await drive(offsets, send, offset=offsets.__getitem__, clock=clock)
    assert interrupted is False
    assert list(sent) == [0, 1, 2]
    for item, offset in offsets.items():
        assert offset <= sent[item] < offset + 0.5  # simulated seconds (a busy CI loop lags)


async def test_open_loop_without_offsets_sends_everything_at_once() -> None:
    inflight = peak = 0

    async def send(_: int) -> None:
        nonlocal inflight, peak
        inflight += 1
        peak = max(peak, inflight)
        await asyncio.sleep(0.02)
        inflight -= 1

    await drive(range(10), send)
    assert peak == 10


async def test_max_inflight_caps_an_open_loop() -> None:
    inflight = peak = done = 0

    async def send(_: int) -> None:
        nonlocal inflight, peak, done
        inflight += 1
        peak = max(peak, inflight)
        await asyncio.sleep(0.01)
        inflight -= 1
        done += 1

    await drive(range(9), send, max_inflight=3)
    assert (peak, done) == (3, 9)


async def test_closed_loop_clients_share_the_items_one_request_each_at_a_time() -> None:
    inflight = peak = 0
    seen: list[int] = []

    async def send(item: int) -> None:
        nonlocal inflight, peak
        inflight += 1
        peak = max(peak, inflight)
        await asyncio.sleep(0.005)
        seen.append(item)
        inflight -= 1

    await drive(range(12), send, clients=4)
    assert peak == 4
    assert sorted(seen) == list(range(12))


async def test_closed_loop_stops_taking_requests_at_the_deadline() -> None:
    count = 0

    async def send(_: object) -> None:
        nonlocal count
        count += 1
        await asyncio.sleep(0.01)

    started = time.monotonic()
    await drive(itertools.repeat(None), send, clients=2, deadline=started + 0.1)
    assert time.monotonic() - started < 0.5
    assert 2 <= count <= 30


async def test_a_stop_event_cancels_what_is_in_flight_and_reports_it() -> None:
    stop = asyncio.Event()
    cancelled = 0

    async def send(_: int) -> None:
        nonlocal cancelled
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled += 1
            raise

    asyncio.get_running_loop().call_later(0.05, stop.set)
    assert await drive(range(3), send, stop=stop) is True
    assert cancelled == 3


async def test_a_raising_send_ends_the_run_with_its_error() -> None:
    async def send(item: int) -> None:
        await asyncio.sleep(0.01 * item)
        if item == 1:
            raise RuntimeError("target broke")

    with pytest.raises(RuntimeError, match="target broke"):
        await drive(range(4), send, clients=2)
