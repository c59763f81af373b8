"""The other gateway replicas of a model, and how many long prefills each has in flight: the
prefill admission limit is cluster-wide, so every replica counts its peers' share."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from pdserve.gateway.fairqueue import PrefillAdmission

log = logging.getLogger("pdserve.gateway.peers")


class PeerAdmission:
    """Polls each peer's `GET /admission` every `interval` seconds; a peer that does not answer
    counts as holding nothing (a dead replica's prefills died with it)."""

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
        self.urls: list[str] = []
        self.counts: dict[str, int] = {}
        admission.others = self.total

    def set_peers(self, urls: list[str]) -> None:
        self.urls = sorted(urls)
        self.counts = {u: c for u, c in self.counts.items() if u in self.urls}

    def total(self) -> int:
        return sum(self.counts.values())

    async def _ask(self, url: str) -> int:
        try:
            async with self.client().get(f"{url}/admission", timeout=self.timeout) as response:
                if response.status != 200:
                    return 0
                body = await response.json()
                return int(body.get("longInFlight", 0))
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            log.debug("peer %s: %s", url, error)
            return 0

    async def poll_once(self) -> None:
        urls = list(self.urls)
        answers = await asyncio.gather(*(self._ask(u) for u in urls))
        self.counts = dict(zip(urls, answers, strict=True))
        self.admission.wake()  # a peer's release may have made room for our queue

    async def run(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval)  # the poll period, not synchronization
