"""The refreshing token: kept until shortly before its expiry (an injected clock), or until
it is refused; issued again one run at a time for threads and event loops alike."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

from pdserve.kube.token_cache import EXPIRY_MARGIN, RefreshingToken, refresh_time

T0 = datetime(2030, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Issued:
    token: str
    expires: datetime | None


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


class Issuer:
    """Issues tok-1, tok-2, ... each valid for `lifetime` (None: no expiry); `gate` holds each
    run until set."""

    def __init__(self, clock: Clock, lifetime: timedelta | None = timedelta(minutes=15)) -> None:
        self.clock = clock
        self.lifetime = lifetime
        self.runs = 0
        self.gate = threading.Event()
        self.gate.set()
        self.fail: Exception | None = None

    def __call__(self) -> Issued:
        self.gate.wait(timeout=10)
        self.runs += 1
        if self.fail is not None:
            raise self.fail
        expires = None if self.lifetime is None else self.clock() + self.lifetime
        return Issued(f"tok-{self.runs}", expires)


def test_kept_until_shortly_before_its_expiry() -> None:
    clock = Clock()
    issuer = Issuer(clock)
    token = RefreshingToken(issuer, clock=clock)
    assert token.get().value == "tok-1"
    clock.now = T0 + timedelta(minutes=15) - EXPIRY_MARGIN - timedelta(seconds=1)
    assert token.get().value == "tok-1"
    assert issuer.runs == 1
    clock.now += timedelta(seconds=1)  # within the margin: due
    assert token.get().value == "tok-2"
    assert token.get().refresh_at == clock.now + timedelta(minutes=15) - EXPIRY_MARGIN
    assert issuer.runs == 2


def test_a_short_lived_token_is_kept_for_half_its_life() -> None:
    assert refresh_time(T0 + timedelta(seconds=2), T0) == T0 + timedelta(seconds=1)
    assert refresh_time(T0 - timedelta(seconds=5), T0) == T0 - timedelta(seconds=5)  # expired
    assert refresh_time(None, T0) is None
    clock = Clock()
    issuer = Issuer(clock, lifetime=timedelta(seconds=2))
    token = RefreshingToken(issuer, clock=clock)
    token.get()
    token.get()
    assert issuer.runs == 1
    clock.now = T0 + timedelta(seconds=1)
    assert token.get().value == "tok-2"


def test_without_expiry_kept_until_refused() -> None:
    clock = Clock()
    issuer = Issuer(clock, lifetime=None)
    token = RefreshingToken(issuer, clock=clock)
    assert token.get().value == "tok-1"
    clock.now = T0 + timedelta(days=365)
    assert token.get().value == "tok-1"
    assert token.get(rejected="tok-1").value == "tok-2"
    # Refused by a request that left before tok-2: tok-2 is handed out, nothing runs.
    assert token.get(rejected="tok-1").value == "tok-2"
    assert issuer.runs == 2


def test_a_failed_run_raises_and_the_next_call_runs_again() -> None:
    clock = Clock()
    issuer = Issuer(clock)
    issuer.fail = RuntimeError("plugin broke")
    token = RefreshingToken(issuer, clock=clock)
    with pytest.raises(RuntimeError, match="plugin broke"):
        token.get()
    issuer.fail = None
    assert token.get().value == "tok-2"


async def test_concurrent_async_callers_share_one_run_off_the_event_loop() -> None:
    clock = Clock()
    issuer = Issuer(clock)
    issuer.gate.clear()
    token = RefreshingToken(issuer, clock=clock)
    waiters = [asyncio.create_task(token.aget()) for _ in range(20)]
    # The run is blocked in its thread, yet the event loop goes on.
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    issuer.gate.set()
    assert {t.value for t in await asyncio.gather(*waiters)} == {"tok-1"}
    assert issuer.runs == 1
    refused = await asyncio.gather(*(token.aget(rejected="tok-1") for _ in range(20)))
    assert {t.value for t in refused} == {"tok-2"}
    assert issuer.runs == 2


async def test_a_cancelled_caller_does_not_cancel_the_run_others_wait_on() -> None:
    clock = Clock()
    issuer = Issuer(clock)
    issuer.gate.clear()
    token = RefreshingToken(issuer, clock=clock)
    cancelled = asyncio.create_task(token.aget())
    other = asyncio.create_task(token.aget())
    await asyncio.sleep(0)
    cancelled.cancel()
    issuer.gate.set()
    assert (await other).value == "tok-1"
    assert issuer.runs == 1


def test_concurrent_threads_share_one_run() -> None:
    clock = Clock()
    issuer = Issuer(clock)
    issuer.gate.clear()
    token = RefreshingToken(issuer, clock=clock)
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(token.get().value)) for _ in range(8)]
    for thread in threads:
        thread.start()
    issuer.gate.set()
    for thread in threads:
        thread.join(timeout=10)
    assert got == ["tok-1"] * 8
    assert issuer.runs == 1
