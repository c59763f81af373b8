"""Fair admission in front of prefill (vLLM dropped its own limit on concurrent long prefills).

Requests are classed by prompt length (or `X-PDServe-Class: document|chat`). Short ones are never
held back: they overtake. Long ones get at most `max_long_per_replica` prefills in flight on each
prefill replica: a long request names the replicas it may use (best first), waits first come
first served until one of them has room, and is granted that one; a long request that has waited
`max_wait_seconds` is admitted anyway on its first choice, so documents cannot starve however busy
the pool is. The limit is cluster-wide: one gateway replica (the leader, `peers.py`) runs this
queue for every replica's long requests; `others` counts the long prefills the peer replicas
report holding on their own (only while they cannot reach the leader).

Behind the compiled data plane the queue runs there instead (`remote`: dataplane_admission.py,
the same rules in dataplane/fairqueue.go), so that the long prompts it serves wait without a
round trip here: this replica's own long requests then wait in it too."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

LONG, SHORT = "long", "short"


@dataclass(frozen=True)
class FairQueueSettings:
    long_prompt_tokens: int = 2048
    max_long_per_replica: int = 1
    max_wait_seconds: float = 10.0


@dataclass(frozen=True)
class QueueState:
    """What a replica's queue holds: what it reports to its peers (`GET /admission`), its
    metrics and its planner's prefill backlog."""

    replicas: dict[str, int]
    """Long prefills admitted, per prefill replica URL."""
    queued: int
    oldest_wait: float
    aged: int

    @property
    def long_in_flight(self) -> int:
        return sum(self.replicas.values())

    @classmethod
    def parse(cls, raw: Any) -> QueueState:
        """From the data plane's /stats `admission` (dataplane/fairqueue.go admissionState)."""
        raw = raw if isinstance(raw, dict) else {}
        replicas = raw.get("replicas") if isinstance(raw.get("replicas"), dict) else {}
        return cls(
            {str(url): int(n) for url, n in replicas.items() if isinstance(n, int) and n > 0},
            int(raw.get("queued") or 0),
            float(raw.get("oldestWaitSeconds") or 0.0),
            int(raw.get("aged") or 0),
        )


class RemoteQueue(Protocol):
    """A replica's queue run in another process (the data plane's)."""

    state: QueueState
    refresh: Callable[[], Awaitable[None]] | None

    def admit(self, replicas: Sequence[str]) -> AbstractAsyncContextManager[str]: ...


@dataclass
class _Waiter:
    since: float
    replicas: Sequence[str]
    granted: asyncio.Future[str] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class PrefillAdmission:
    def __init__(
        self, settings: FairQueueSettings | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings or FairQueueSettings()
        self.clock = clock
        self.in_flight: Counter[str] = Counter()
        """Long prefills admitted here, per prefill replica URL."""
        self.queue: deque[_Waiter] = deque()
        self.aged = 0
        self.others: Callable[[str], int] = lambda _: 0  # peers' long prefills on a replica
        self.remote: RemoteQueue | None = None
        """Where this replica's queue runs when not here (the data plane's)."""

    @property
    def queued(self) -> int:
        return self.remote.state.queued if self.remote is not None else len(self.queue)

    async def fresh_state(self) -> QueueState:
        """state(), read afresh where the queue runs elsewhere (state() may be a second old)."""
        if self.remote is not None and self.remote.refresh is not None:
            await self.remote.refresh()
        return self.state()

    def state(self) -> QueueState:
        if self.remote is not None:
            return self.remote.state
        return QueueState(dict(self.in_flight), len(self.queue), self.oldest_wait(), self.aged)

    @property
    def long_in_flight(self) -> int:
        return sum(self.in_flight.values())

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

    def _free(self, replicas: Sequence[str], room: dict[str, int]) -> str | None:
        """The first of `replicas` with room for another long prefill (`room`: what is known
        of it so far in this pass, filled in here)."""
        for replica in replicas:
            if replica not in room:
                taken = self.in_flight[replica] + self.others(replica)
                room[replica] = self.settings.max_long_per_replica - taken
            if room[replica] > 0:
                return replica
        return None

    def _grant(self, waiter: _Waiter, replica: str) -> None:
        self.in_flight[replica] += 1
        waiter.granted.set_result(replica)

    def wake(self) -> None:
        """Admit queued long requests, oldest first, while one of their replicas has room (after
        a release here or a peer's). A request whose replicas are all busy does not hold back a
        later one that may use another replica.

        Each replica's room is counted once per pass (the peers' counts are not cheap), so a
        release with a long queue behind it costs a dictionary lookup per waiter."""
        room: dict[str, int] = {}
        waiting: deque[_Waiter] = deque()
        for waiter in self.queue:
            if waiter.granted.done():
                continue
            replica = self._free(waiter.replicas, room)
            if replica is None:
                waiting.append(waiter)
            else:
                room[replica] -= 1
                self._grant(waiter, replica)
        self.queue = waiting

    def _release(self, replica: str) -> None:
        self.in_flight[replica] -= 1
        if self.in_flight[replica] <= 0:
            del self.in_flight[replica]
        self.wake()

    @asynccontextmanager
    async def admit(self, request_class: str, replicas: Sequence[str]) -> AsyncIterator[str | None]:
        """Hold a long-prefill slot on one of `replicas` (the preferred first) and yield it;
        short requests pass straight through (None)."""
        if request_class != LONG or not replicas:
            yield None
            return
        if self.remote is not None:
            async with self.remote.admit(replicas) as granted:
                yield granted
            return
        waiter = _Waiter(self.clock(), list(replicas))
        self.queue.append(waiter)
        self.wake()  # granted at once if none of those before it can use a free replica
        if not waiter.granted.done():
            try:
                await asyncio.wait_for(
                    asyncio.shield(waiter.granted), self.settings.max_wait_seconds
                )
            except TimeoutError:
                # Aging: waited long enough, go now (on the first choice) even above the limit.
                if waiter in self.queue:
                    self.queue.remove(waiter)
                if not waiter.granted.done():
                    self.aged += 1
                    self._grant(waiter, waiter.replicas[0])
            except asyncio.CancelledError:
                if waiter in self.queue:
                    self.queue.remove(waiter)
                if waiter.granted.done():
                    self._release(waiter.granted.result())  # granted as the client left
                raise
        replica = waiter.granted.result()
        try:
            yield replica
        finally:
            self._release(replica)
