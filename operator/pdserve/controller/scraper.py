"""The skeleton of the operator's background scrapers (transport health, Builtin autoscaling):
a shared HTTP client, a fixed period, and a callback that asks for a reconcile of a model."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

log = logging.getLogger("pdserve.scraper")
Key = tuple[str, str]  # namespace, name


class PeriodicScraper:
    def __init__(
        self,
        on_change: Callable[[Key], None],
        *,
        interval: float = 15.0,
        timeout: float = 2.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.on_change = on_change
        self.interval = interval
        self.client = client or httpx.AsyncClient(timeout=timeout)

    async def fetch_text(self, url: str) -> str | None:
        """A pod's /metrics text; None when it does not answer (logged at debug level)."""
        try:
            response = await self.client.get(url)
            response.raise_for_status()
            return response.text
        except httpx.HTTPError as error:
            log.debug("scraping %s failed: %s", url, error)
            return None

    async def scrape_once(self) -> None:
        raise NotImplementedError

    async def run_forever(self) -> None:
        while True:
            await self.scrape_once()
            await asyncio.sleep(self.interval)  # the scrape period, not synchronization

    async def close(self) -> None:
        await self.client.aclose()
