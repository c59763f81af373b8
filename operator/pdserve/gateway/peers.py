"""The other gateway replicas of a model, and one of them that decides every long-prefill
admission: the prefill admission limit is cluster-wide.

The replica with the lowest URL among those that can see each other (itself and the peers that
answered the last poll) is the leader. Every other replica asks it for a slot with
`POST /admission/hold`, naming the prefill replicas it may use, best first: the leader queues the
request in its own fair queue (first come first served, aging included, over the whole model),
answers `granted <replica>` when one of them has room and keeps the connection open; the slot is
held until the asking replica closes that connection (its prefill ended, or it died). One process
decides, so the limit is exact. While no leader can be reached (start-up, a leader that just
died, a replica that does not know its own address), a replica admits on its own and counts what
its peers report holding: the limit can then overshoot by one per replica until the next
poll."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import aiohttp

from pdserve.gateway.fairqueue import LONG, PrefillAdmission

log = logging.getLogger("pdserve.gateway.peers")

GRANTED = "granted"


class LeaderUnavailable(Exception):
    """The leader could not be asked or did not answer: admit here instead."""


class PeerAdmission:
    """Polls each peer's `GET /admission` every `interval` seconds; a peer that does not answer
    counts as holding nothing (a dead replica's prefills died with it) and cannot lead."""

    def __init__(
        self,
        admission: PrefillAdmission,
        client: Callable[[], aiohttp.ClientSession],
        *,
        interval: float = 0.1,
        timeout: float = 0.5,
    ) -> None:
        self.admission = admission
        self.client = client
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.self_url: str | None = None
        """This replica's own URL as its peers reach it; None: it cannot take part in electing
        a leader (it admits on its own)."""
        self.urls: list[str] = []
        self.counts: dict[str, dict[str, int]] = {}
        """Per peer: the long prefills it holds on its own, per prefill replica."""
        self.queued_at: dict[str, int] = {}
        self.live: set[str] = set()
        self.leader_errors = 0
        admission.others = self.total

    def set_peers(self, urls: list[str], self_url: str | None = None) -> None:
        self.urls = sorted(urls)
        self.self_url = self_url
        self.counts = {u: c for u, c in self.counts.items() if u in self.urls}
        self.queued_at = {u: c for u, c in self.queued_at.items() if u in self.urls}
        self.live &= set(self.urls)

    def total(self, replica: str) -> int:
        return sum(held.get(replica, 0) for held in self.counts.values())

    def queued(self) -> int:
        """Long requests waiting in the peers' queues (the leader's holds everyone's)."""
        return sum(self.queued_at.values())

    def leader(self) -> str | None:
        """The peer that admits long prefills for every replica; None when this replica does
        (it is the leader, or it cannot know: no own URL)."""
        if self.self_url is None or not self.live:
            return None
        lowest = min(self.live)
        return lowest if lowest < self.self_url else None

    async def _ask(self, url: str) -> tuple[dict[str, int], int] | None:
        try:
            async with self.client().get(f"{url}/admission", timeout=self.timeout) as response:
                if response.status != 200:
                    return None
                body = await response.json()
                held = {str(k): int(v) for k, v in (body.get("replicas") or {}).items()}
                return held, int(body.get("queued", 0))
        except (TimeoutError, aiohttp.ClientError, ValueError, TypeError, AttributeError) as error:
            log.debug("peer %s: %s", url, error)
            return None

    async def poll_once(self) -> None:
        urls = list(self.urls)
        answers = dict(zip(urls, await asyncio.gather(*(self._ask(u) for u in urls)), strict=True))
        self.live = {url for url, answer in answers.items() if answer is not None}
        self.counts = {url: answer[0] if answer else {} for url, answer in answers.items()}
        self.queued_at = {url: answer[1] if answer else 0 for url, answer in answers.items()}
        self.admission.wake()  # a peer's release may have made room for our queue

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval)  # the poll period, not synchronization

    @asynccontextmanager
    async def slot(self, request_class: str, replicas: Sequence[str]) -> AsyncIterator[str | None]:
        """Hold a long-prefill slot on one of `replicas` (best first) and yield it, from the
        leader or, when there is none to ask, from this replica's own queue; short requests pass
        straight through (None)."""
        if request_class != LONG or not replicas:
            yield None
            return
        async with AsyncExitStack() as stack:
            granted: str | None = None
            if (leader := self.leader()) is not None:
                try:
                    granted = await stack.enter_async_context(self._hold(leader, replicas))
                except LeaderUnavailable as error:
                    self.leader_errors += 1
                    log.warning("admission leader %s: %s; admitting here", leader, error)
            if granted is None:
                granted = await stack.enter_async_context(self.admission.admit(LONG, replicas))
            yield granted

    @asynccontextmanager
    async def _hold(self, leader: str, replicas: Sequence[str]) -> AsyncIterator[str]:
        # The leader ages a queued request after max_wait_seconds: a grant later than twice
        # that means the leader is stuck, and this replica admits on its own.
        grant_timeout = 2 * self.admission.settings.max_wait_seconds + 1
        try:
            response = await self.client().post(
                f"{leader}/admission/hold",
                json={"replicas": list(replicas)},
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.timeout.total, sock_read=None
                ),
            )
        except (TimeoutError, aiohttp.ClientError) as error:
            raise LeaderUnavailable(str(error) or type(error).__name__) from None
        try:
            if response.status != 200:
                raise LeaderUnavailable(f"HTTP {response.status}")
            try:
                line = await asyncio.wait_for(response.content.readline(), grant_timeout)
            except (TimeoutError, aiohttp.ClientError) as error:
                raise LeaderUnavailable(str(error) or type(error).__name__) from None
            word, _, replica = line.decode(errors="replace").strip().partition(" ")
            if word != GRANTED or replica not in replicas:
                raise LeaderUnavailable(f"unexpected answer {line[:120]!r}")
            yield replica
        finally:
            response.close()  # closing the connection releases the slot on the leader
