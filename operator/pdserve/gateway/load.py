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
    rf"^({'|'.join(map(re.escape, FIELDS))})(?:\{{([^}}]*)\}})?\s+([0-9.eE+-]+)", re.MULTILINE
)
ENGINE_LABEL = re.compile(r'(?:^|,)\s*engine="([^"]*)"')
CACHE_CONFIG = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
LABEL = re.compile(r'(\w+)="([^"]*)"')
# Called with a decode engine and the KV transfers it finished since the previous scrape:
# (how many, seconds in all, as the engine reports them).
TransferListener = Callable[[Endpoint, float, float], None]


def _add(load: dict[str, float], field: str, number: float) -> None:
    load[field] = max(load[field], number) if field == "kv_usage" else load[field] + number


def parse_engine_loads(text: str) -> list[dict[str, float]]:
    """Per engine the pod's API server manages, in the order of its `engine` label (vLLM's
    global data-parallel rank): the order of the indexes X-data-parallel-rank takes."""
    engines: dict[str, dict[str, float]] = {}
    for name, labels, value in SAMPLE.findall(text):
        found = ENGINE_LABEL.search(labels)
        engine = found.group(1) if found else ""
        load = engines.setdefault(engine, dict.fromkeys(FIELDS.values(), 0.0))
        _add(load, FIELDS[name], float(value))

    def order(engine: str) -> tuple[int, str]:
        return (int(engine), "") if engine.isdigit() else (1 << 30, engine)

    return [engines[engine] for engine in sorted(engines, key=order)]


def parse_load(text: str) -> dict[str, float]:
    """Summed over an engine's label sets (data-parallel ranks); KV usage the maximum."""
    return total_load(parse_engine_loads(text))


def total_load(engines: list[dict[str, float]]) -> dict[str, float]:
    load = dict.fromkeys(FIELDS.values(), 0.0)
    for each in engines:
        for field, number in each.items():
            _add(load, field, number)
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


def by_pod(targets: list[Endpoint]) -> list[list[Endpoint]]:
    """Routing targets grouped by their server (the ranks of one pod scrape together)."""
    pods: dict[str, list[Endpoint]] = {}
    for target in targets:
        pods.setdefault(target.url, []).append(target)
    return list(pods.values())


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
        self.warned: set[str] = set()

    async def scrape(self, targets: list[Endpoint], decode: bool = False) -> None:
        """One pod's /metrics, for its routing targets: the pod itself, or each of its
        data-parallel ranks (Endpoint.rank) from the series of that engine."""
        pod = targets[0]
        try:
            async with self.session.get(
                f"{pod.url}/metrics", timeout=aiohttp.ClientTimeout(total=2)
            ) as response:
                if response.status != 200:
                    return
                text = await response.text()
        except (TimeoutError, aiohttp.ClientError):
            return  # the request path marks endpoints down; keep the last known load
        engines = parse_engine_loads(text)
        total = total_load(engines)
        for target in targets:
            if target.rank is None:
                load = total
            elif target.rank < len(engines):
                load = engines[target.rank]
            else:
                self.warn_missing_rank(target, len(engines))
                load = total  # no series of its own: as busy as the whole pod
            target.waiting, target.running = load["waiting"], load["running"]
            target.kv_usage = load["kv_usage"]
            if decode:
                target.kv_blocks, target.kv_block_size = parse_cache_config(text)
        if decode:
            self.note_transfers(pod, total["transfers"], total["transfer_seconds"])

    def warn_missing_rank(self, target: Endpoint, engines: int) -> None:
        if target.url not in self.warned:
            self.warned.add(target.url)
            log.warning(
                "%s exposes %d engine(s) in /metrics, fewer than the data-parallel ranks it is "
                "routed as (dataParallelLocal): is its --data-parallel-size what the routing "
                "config says?", target.label, engines,
            )  # fmt: skip

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
                *(self.scrape(pod) for pod in by_pod(pools["prefill"])),
                *(self.scrape(pod, decode=True) for pod in by_pod(pools["decode"])),
            )
            urls = {e.url for e in pools["decode"]}
            for gone in set(self.transfer_totals) - urls:
                del self.transfer_totals[gone]
            await asyncio.sleep(self.interval)  # the scrape period, not synchronization
