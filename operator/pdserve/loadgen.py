"""The load generator every benchmark and the simulators' experiment send their requests with.

`drive` decides when each request goes out: open loop (each at its planned offset on the run's
clock, or all at once), or closed loop (N clients, each sending its next request when the last
one answered, until the requests run out or a deadline passes), optionally under a cap of
requests in flight; a stop event ends it early. What one request is and what it records is the
caller's `send`: `pdserve bench run` streams OpenAI requests into per-request records
(bench/runner.stream_into), the gateway overhead benchmark times plain or streamed calls
(timed_post, first_event), the seed article's experiment (sim/experiment.py) sends Poisson
arrivals as offsets. A `send` that raises ends the run with its exception, as a failed request in an
asyncio.gather would."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import suppress
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


class Clock:
    """Milliseconds on the run's clock: the wall-clock epoch at the start, then elapsed real
    time divided by the time scale (simulated time against scaled simulators)."""

    def __init__(self, time_scale: float) -> None:
        self.scale = time_scale
        self.epoch_ms = time.time() * 1000
        self.start = time.perf_counter()

    def now_ms(self) -> float:
        return self.epoch_ms + (time.perf_counter() - self.start) / self.scale * 1000

    def elapsed(self) -> float:
        """Simulated seconds since the start."""
        return (time.perf_counter() - self.start) / self.scale


async def drive(
    items: Iterable[T],
    send: Callable[[T], Awaitable[None]],
    *,
    clients: int | None = None,
    offset: Callable[[T], float] | None = None,
    clock: Clock | None = None,
    max_inflight: int | None = None,
    deadline: float | None = None,
    stop: asyncio.Event | None = None,
) -> bool:
    """Send every item (await send(item)) and wait for them all; True when `stop` ended the run
    first (the requests in flight are then cancelled).

    clients None: open loop, each item sent `offset(item)` seconds of `clock` after the start
    (simulated seconds when the clock is scaled; every item at once without offsets). clients N:
    closed loop with N clients sharing the items; with a deadline (time.monotonic()), a client
    starts no request after it. max_inflight: at most that many requests in flight."""
    stop = stop or asyncio.Event()
    clock = clock or Clock(1.0)
    slots = asyncio.Semaphore(max_inflight) if max_inflight is not None else None
    tasks: set[asyncio.Task[None]] = set()
    failures: list[BaseException] = []

    def finished(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            failures.append(error)

    def start(work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        tasks.add(task)
        task.add_done_callback(finished)

    async def one(item: T) -> None:
        try:
            await send(item)
        finally:
            if slots is not None:
                slots.release()

    async def acquire() -> bool:
        """A slot under max_inflight, unless stopped first."""
        if slots is None:
            return True
        slot = asyncio.ensure_future(slots.acquire())
        if await _unless_stopped(stop, slot):
            return True
        slot.cancel()
        return False

    if clients is None:
        for item in items:
            delay = ((offset(item) if offset else 0.0) - clock.elapsed()) * clock.scale
            if delay > 0:
                with suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
            if stop.is_set() or failures or not await acquire():
                break
            start(one(item))
    else:
        queue: Iterator[T] = iter(items)

        async def client() -> None:
            for item in queue:
                if deadline is not None and time.monotonic() >= deadline:
                    return
                if not await acquire():
                    return
                await one(item)

        for _ in range(clients):
            start(client())
    while tasks and not stop.is_set() and not failures:
        done = asyncio.ensure_future(_any(tasks))
        if not await _unless_stopped(stop, done):
            done.cancel()
    interrupted = stop.is_set()
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if failures:
        raise failures[0]
    return interrupted


async def _unless_stopped(stop: asyncio.Event, work: asyncio.Future[Any]) -> bool:
    """Wait for work or stop, whichever comes first; True when the work finished."""
    waiter = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    return work.done()


async def _any(tasks: set[asyncio.Task[None]]) -> None:
    await asyncio.wait(set(tasks), return_when=asyncio.FIRST_COMPLETED)


# ---- plain requests ------------------------------------------------------------------------------
async def timed_post(client: httpx.AsyncClient, url: str, body: Any) -> float | None:
    """POST a JSON body and read the answer: the seconds it took, None unless it was a 200."""
    started = time.monotonic()
    response = await client.post(url, json=body)
    await response.aread()
    if response.status_code != 200:
        return None
    return time.monotonic() - started


async def first_event(client: httpx.AsyncClient, url: str, body: Any) -> float | None:
    """POST a streamed request and read it to the end: seconds to its first `data: {` event
    (None when none came)."""
    started = time.monotonic()
    first: float | None = None
    async with client.stream("POST", url, json=body) as response:
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - started
    return first
