"""Engine load from their own Prometheus metrics, scraped on a short interval."""

from __future__ import annotations

import asyncio
import logging
import re

import aiohttp

from pdserve.gateway.endpoints import Endpoint, Endpoints

log = logging.getLogger("pdserve.gateway.load")
SAMPLE = re.compile(
    r"^(vllm:num_requests_waiting|vllm:num_requests_running|vllm:kv_cache_usage_perc)"
    r"(?:\{[^}]*\})?\s+([0-9.eE+-]+)",
    re.MULTILINE,
)
FIELDS = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


def parse_load(text: str) -> dict[str, float]:
    """waiting/running summed over an engine's label sets (data-parallel ranks); KV usage max."""
    load = {"waiting": 0.0, "running": 0.0, "kv_usage": 0.0}
    for name, value in SAMPLE.findall(text):
        field = FIELDS[name]
        number = float(value)
        load[field] = max(load[field], number) if field == "kv_usage" else load[field] + number
    return load


class LoadScraper:
    def __init__(
        self, endpoints: Endpoints, session: aiohttp.ClientSession, interval: float = 0.5
    ) -> None:
        self.endpoints, self.session, self.interval = endpoints, session, interval

    async def scrape(self, endpoint: Endpoint) -> None:
        try:
            async with self.session.get(
                f"{endpoint.url}/metrics", timeout=aiohttp.ClientTimeout(total=2)
            ) as response:
                if response.status != 200:
                    return
                load = parse_load(await response.text())
        except (TimeoutError, aiohttp.ClientError):
            return  # the request path marks endpoints down; keep the last known load
        endpoint.waiting, endpoint.running, endpoint.kv_usage = (
            load["waiting"],
            load["running"],
            load["kv_usage"],
        )

    async def run(self) -> None:
        while True:
            engines = [*self.endpoints.pools["prefill"], *self.endpoints.pools["decode"]]
            await asyncio.gather(*(self.scrape(e) for e in engines))
            await asyncio.sleep(self.interval)  # the scrape period, not synchronization
