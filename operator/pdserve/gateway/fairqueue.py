"""Fair admission in front of prefill (vLLM dropped its own limit on concurrent long prefills).

Requests are classed by prompt length (or `X-PDServe-Class: document|chat`). Short ones are never
held back: they overtake. Long ones get at most `max_long_per_replica` prefills in flight per
prefill replica, first come first served; a long request that has waited `max_wait_seconds` is
admitted anyway, so documents cannot starve however busy the pool is. The limit is cluster-wide:
one gateway replica (the leader, `peers.py`) runs this queue for every replica's long requests;
`others` counts the long prefills the peer replicas report holding on their own (only while they
cannot reach the leader)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

LONG, SHORT = "long", "short"


@dataclass(frozen=True)
class FairQueueSettings:
    long_prompt_tokens: int = 2048
    max_long_per_replica: int = 1
    max_wait_seconds: float = 10.0


@dataclass
class _Waiter:
    since: float
    admitted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class PrefillAdmission:
    def __init__(
        self, settings: FairQueueSettings | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings or FairQueueSettings()
        self.clock = clock
        self.long_in_flight = 0
        self.queue: deque[_Waiter] = deque()
        self.aged = 0
        self.replicas = 1
        self.others: Callable[[], int] = lambda: 0  # peers' long prefills in flight

    def request_class(self, prompt_tokens: int | None, declared: str | None) -> str:
        if declared in ("document", LONG):
            return LONG
        if declared in ("chat", SHORT):
            return SHORT
        if prompt_tokens is not None and prompt_tokens >= self.settings.long_prompt_tokens:
            return LONG
        return SHORT

    def oldest_wait(self) -> float:
        return self.clock() - self.queue[0].since if self.queue else 0.0

    def _room(self) -> bool:
        limit = self.settings.max_long_per_replica * self.replicas
        return self.long_in_flight + self.others() < limit

    def wake(self) -> None:
        """Admit queued long requests while there is room (after a release here or a peer's)."""
        while self.queue and self._room():
            waiter = self.queue.popleft()
            if not waiter.admitted.done():
                self.long_in_flight += 1
                waiter.admitted.set_result(None)

    def _release(self) -> None:
        self.long_in_flight -= 1
        self.wake()

    @asynccontextmanager
    async def admit(self, request_class: str, replicas: int) -> AsyncIterator[None]:
        """Hold a long-prefill slot (short requests pass straight through)."""
        if request_class != LONG:
            yield
            return
        self.replicas = max(1, replicas)
        if self._room() and not self.queue:
            self.long_in_flight += 1
        else:
            waiter = _Waiter(self.clock())
            self.queue.append(waiter)
            try:
                await asyncio.wait_for(
                    asyncio.shield(waiter.admitted), self.settings.max_wait_seconds
                )
            except TimeoutError:
                # Aging: waited long enough, go now even above the limit.
                if waiter in self.queue:
                    self.queue.remove(waiter)
                if not waiter.admitted.done():
                    self.aged += 1
                    self.long_in_flight += 1
                    waiter.admitted.set_result(None)
            except asyncio.CancelledError:
                if waiter in self.queue:
                    self.queue.remove(waiter)
                if waiter.admitted.done():
                    self._release()  # admitted as the client left: pass the slot on
                raise
        try:
            yield
        finally:
            self._release()
