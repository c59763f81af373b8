"""Engine load from their own Prometheus metrics, scraped on a short interval; and decode
engines' KV transfer times (vllm:nixl_xfer_time_seconds), which tell Auto mode how fast the KV
path is for every P/D request, streamed or not."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

import aiohttp

from pdserve.gateway.endpoints import Endpoint, Endpoints
from pdserve.vllm import metrics
from pdserve.vllm.metrics import TransferCounters

log = logging.getLogger("pdserve.gateway.load")
FIELDS = {
    metrics.NUM_REQUESTS_WAITING: "waiting",
    metrics.NUM_REQUESTS_RUNNING: "running",
    metrics.KV_CACHE_USAGE: "kv_usage",
    metrics.count(metrics.NIXL_XFER_TIME): "transfers",
    metrics.total(metrics.NIXL_XFER_TIME): "transfer_seconds",
}
# A regex, not a Prometheus parser: an engine's full exposition is tens of KB every scrape.
SAMPLE = re.compile(
    rf"^({'|'.join(map(re.escape, FIELDS))})(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)", re.MULTILINE
)
CACHE_CONFIG = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
LABEL = re.compile(r'(\w+)="([^"]*)"')
# Called with a decode engine and the KV transfers it finished since the previous scrape:
# (how many, seconds in all, as the engine reports them).
TransferListener = Callable[[Endpoint, float, float], None]


def parse_load(text: str) -> dict[str, float]:
    """Summed over an engine's label sets (data-parallel ranks); KV usage the maximum."""
    load = dict.fromkeys(FIELDS.values(), 0.0)
    for name, value in SAMPLE.findall(text):
        field = FIELDS[name]
        number = float(value)
        load[field] = max(load[field], number) if field == "kv_usage" else load[field] + number
    return load


def parse_cache_config(text: str) -> tuple[int, int]:
    """(num_gpu_blocks, block_size) from vllm:cache_config_info: the smallest rank's blocks (a
    hold lands on one rank), (0, 0) when the engine does not say."""
    blocks: list[int] = []
    size = 0
    for labels in CACHE_CONFIG.findall(text):
        values = dict(LABEL.findall(labels))
        try:
            blocks.append(int(values["num_gpu_blocks"]))
            size = int(values["block_size"])
        except (KeyError, ValueError):
            continue
    return (min(blocks), size) if blocks else (0, 0)


class LoadScraper:
    def __init__(
        self,
        endpoints: Endpoints,
        session: aiohttp.ClientSession,
        interval: float = 0.5,
        on_transfers: TransferListener | None = None,
    ) -> None:
        self.endpoints, self.session, self.interval = endpoints, session, interval
        self.on_transfers = on_transfers
        self.transfer_totals: dict[str, TransferCounters] = {}
        """Per decode engine URL, its cumulative transfer counters at the last scrape."""

    async def scrape(self, endpoint: Endpoint, decode: bool = False) -> None:
        try:
            async with self.session.get(
                f"{endpoint.url}/metrics", timeout=aiohttp.ClientTimeout(total=2)
            ) as response:
                if response.status != 200:
                    return
                text = await response.text()
                load = parse_load(text)
        except (TimeoutError, aiohttp.ClientError):
            return  # the request path marks endpoints down; keep the last known load
        endpoint.waiting, endpoint.running, endpoint.kv_usage = (
            load["waiting"],
            load["running"],
            load["kv_usage"],
        )
        if decode:
            endpoint.kv_blocks, endpoint.kv_block_size = parse_cache_config(text)
            self.note_transfers(endpoint, load["transfers"], load["transfer_seconds"])

    def note_transfers(self, endpoint: Endpoint, transfers: float, seconds: float) -> None:
        now = TransferCounters(transfers=transfers, seconds=seconds)
        before = self.transfer_totals.get(endpoint.url)
        self.transfer_totals[endpoint.url] = now
        if before is None or self.on_transfers is None:
            return  # the history before this gateway started says nothing about its requests
        window = now.since(before)  # an engine restart counts from zero
        if window.transfers > 0:
            self.on_transfers(endpoint, window.transfers, window.seconds)

    async def run(self) -> None:
        while True:
            pools = self.endpoints.pools
            await asyncio.gather(
                *(self.scrape(e) for e in pools["prefill"]),
                *(self.scrape(e, decode=True) for e in pools["decode"]),
            )
            urls = {e.url for e in pools["decode"]}
            for gone in set(self.transfer_totals) - urls:
                del self.transfer_totals[gone]
            await asyncio.sleep(self.interval)  # the scrape period, not synchronization
