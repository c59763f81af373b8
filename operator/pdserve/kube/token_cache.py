"""A token that is issued again when it nears its expiry or the API server refuses it, by a
blocking call (an exec plugin's run), one at a time however many callers want it at once, from
threads (kopf's login handler) or event loops (the async client)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol

# Renewed this long before its expiry (at most half its lifetime), so that no request leaves
# with a token that expires on the way.
EXPIRY_MARGIN = timedelta(seconds=10)


class Issued(Protocol):
    @property
    def token(self) -> str: ...

    @property
    def expires(self) -> datetime | None: ...


@dataclass(frozen=True)
class CachedToken:
    value: str
    refresh_at: datetime | None  # None: kept until the API server refuses it


def utc_now() -> datetime:
    return datetime.now(UTC)


def refresh_time(
    expires: datetime | None, issued_at: datetime, margin: timedelta = EXPIRY_MARGIN
) -> datetime | None:
    """When a token issued at `issued_at` that expires at `expires` is issued again."""
    if expires is None:
        return None
    lifetime = max(expires - issued_at, timedelta(0))
    return expires - min(margin, lifetime / 2)


class RefreshingToken:
    """`issue` is called when there is no token yet, when the one held reaches its refresh
    time, or when a caller names it as refused; callers arriving while it runs wait for that
    run. A failed run raises to every caller waiting on it; the next call runs it again."""

    def __init__(
        self,
        issue: Callable[[], Issued],
        *,
        clock: Callable[[], datetime] = utc_now,
        margin: timedelta = EXPIRY_MARGIN,
    ) -> None:
        self._issue = issue
        self.clock = clock
        self._margin = margin
        self._lock = threading.Lock()
        self._cached: CachedToken | None = None
        self._running: Future[CachedToken] | None = None

    def get(self, rejected: str | None = None) -> CachedToken:
        """The token (`rejected`: one the API server refused, never handed back). Blocks while
        `issue` runs: call it from a thread, and `aget` from async code."""
        return self._usable(rejected) or self._issuing(rejected).result()

    async def aget(self, rejected: str | None = None) -> CachedToken:
        """`get` without blocking the event loop: `issue` runs in a thread of its own."""
        usable = self._usable(rejected)
        if usable is not None:
            return usable
        # Shielded: a cancelled caller must not cancel the run the others wait on.
        return await asyncio.shield(asyncio.wrap_future(self._issuing(rejected)))

    def _usable(self, rejected: str | None) -> CachedToken | None:
        cached = self._cached
        if cached is None or cached.value == rejected:
            return None
        if cached.refresh_at is not None and self.clock() >= cached.refresh_at:
            return None
        return cached

    def _issuing(self, rejected: str | None) -> Future[CachedToken]:
        with self._lock:
            if self._running is not None:
                return self._running
            future: Future[CachedToken] = Future()
            usable = self._usable(rejected)  # another caller's run may have just finished
            if usable is not None:
                future.set_result(usable)
                return future
            self._running = future
        threading.Thread(
            target=self._run, args=(future,), name="exec credential plugin", daemon=True
        ).start()
        return future

    def _run(self, future: Future[CachedToken]) -> None:
        try:
            issued = self._issue()
            token = CachedToken(
                issued.token, refresh_time(issued.expires, self.clock(), self._margin)
            )
        except BaseException as error:  # handed to the callers, whatever it is
            with self._lock:
                self._running = None
            with contextlib.suppress(InvalidStateError):
                future.set_exception(error)
            return
        with self._lock:
            self._cached = token
            self._running = None
        with contextlib.suppress(InvalidStateError):
            future.set_result(token)
