"""Continuous KV transport health: the operator scrapes decode engines' NIXL metrics
(vllm:nixl_xfer_time_seconds, vllm:nixl_num_failed_transfers, vllm:nixl_num_kv_expired_reqs) in
the background and judges each model's transfers over the last interval against a budget
derived from its TTFT SLO. Reconcile reads the cached verdict into TransportHealthy."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.api import DisaggregatedModel

log = logging.getLogger("pdserve.health")
Key = tuple[str, str]
# Share of the TTFT SLO a KV handoff may take: prefill and decode's first step need the rest.
TRANSFER_SHARE_OF_TTFT = 0.5


@dataclass(frozen=True)
class TransferCounters:
    """Cumulative NIXL counters of one or more decode engines."""

    transfers: float = 0.0
    seconds: float = 0.0
    failed: float = 0.0
    expired: float = 0.0

    def __add__(self, other: TransferCounters) -> TransferCounters:
        return TransferCounters(
            self.transfers + other.transfers,
            self.seconds + other.seconds,
            self.failed + other.failed,
            self.expired + other.expired,
        )

    def since(self, before: TransferCounters | None) -> TransferCounters:
        """What happened since `before`; a counter that went down (engine restarted) counts
        from zero."""
        if before is None:
            return self

        def delta(now: float, then: float) -> float:
            return now - then if now >= then else now

        return TransferCounters(
            delta(self.transfers, before.transfers), delta(self.seconds, before.seconds),
            delta(self.failed, before.failed), delta(self.expired, before.expired),
        )  # fmt: skip


def parse_counters(text: str) -> TransferCounters:
    totals = {"transfers": 0.0, "seconds": 0.0, "failed": 0.0, "expired": 0.0}
    wanted = {
        "vllm:nixl_xfer_time_seconds_count": "transfers",
        "vllm:nixl_xfer_time_seconds_sum": "seconds",
        "vllm:nixl_num_failed_transfers_total": "failed",
        "vllm:nixl_num_failed_transfers": "failed",
        "vllm:nixl_num_kv_expired_reqs_total": "expired",
        "vllm:nixl_num_kv_expired_reqs": "expired",
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = wanted.get(sample.name)
            if field is not None:
                totals[field] += sample.value
    return TransferCounters(**totals)


@dataclass(frozen=True)
class HealthVerdict:
    healthy: bool | None
    reason: str
    message: str


def transfer_budget_seconds(dm: DisaggregatedModel) -> float | None:
    ttft_ms = dm.spec.gateway.slo.ttft_ms
    return None if ttft_ms is None else ttft_ms / 1000 * TRANSFER_SHARE_OF_TTFT


def judge_health(window: TransferCounters, budget: float | None) -> HealthVerdict | None:
    """None: nothing happened in the window (keep the last verdict)."""
    if window.transfers == 0 and window.failed == 0 and window.expired == 0:
        return None
    average = window.seconds / window.transfers if window.transfers else None
    numbers = f"{int(window.transfers)} transfers"
    if average is not None:
        numbers += f", average {average * 1000:.0f} ms"
    if budget is not None:
        numbers += f" (budget {budget * 1000:.0f} ms: half the TTFT SLO)"
    if window.failed:
        return HealthVerdict(False, "TransferFailures",
                             f"{int(window.failed)} failed KV transfers; {numbers}")  # fmt: skip
    if window.expired:
        return HealthVerdict(False, "LeasesExpiring",
                             f"{int(window.expired)} KV leases expired before decode pulled "
                             f"them (raise kvTransfer.leaseDurationSeconds or add decode "
                             f"capacity); {numbers}")  # fmt: skip
    if average is not None and budget is not None and average > budget:
        return HealthVerdict(False, "SlowTransfers", numbers)
    return HealthVerdict(True, "Healthy", numbers)


@dataclass
class _Tracked:
    urls: list[str]
    budget: float | None
    last: TransferCounters | None = None
    verdict: HealthVerdict | None = None


class TransportMonitor:
    """Scrapes the decode engines of every tracked model every `interval` seconds."""

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
        self.tracked: dict[Key, _Tracked] = {}

    def track(self, key: Key, urls: Sequence[str], budget: float | None) -> None:
        entry = self.tracked.get(key)
        if entry is None:
            self.tracked[key] = _Tracked(list(urls), budget)
        else:
            entry.urls, entry.budget = list(urls), budget

    def forget(self, key: Key) -> None:
        self.tracked.pop(key, None)

    def verdict(self, key: Key) -> HealthVerdict | None:
        entry = self.tracked.get(key)
        return entry.verdict if entry else None

    async def _fetch(self, url: str) -> TransferCounters | None:
        try:
            response = await self.client.get(url)
            response.raise_for_status()
            return parse_counters(response.text)
        except (httpx.HTTPError, ValueError) as error:
            log.debug("scraping %s failed: %s", url, error)
            return None

    async def scrape_once(self) -> None:
        for key, entry in list(self.tracked.items()):
            if not entry.urls:
                continue
            results = await asyncio.gather(*(self._fetch(u) for u in entry.urls))
            reached = [r for r in results if r is not None]
            if not reached:
                verdict: HealthVerdict | None = HealthVerdict(
                    None, "MetricsUnreachable",
                    f"none of {len(entry.urls)} decode engines answered on /metrics",
                )  # fmt: skip
            else:
                total = sum(reached, TransferCounters())
                verdict = judge_health(total.since(entry.last), entry.budget)
                entry.last = total
            if verdict is not None and verdict != entry.verdict:
                entry.verdict = verdict
                self.on_change(key)

    async def run_forever(self) -> None:
        while True:
            await self.scrape_once()
            await asyncio.sleep(self.interval)  # the scrape period, not synchronization

    async def close(self) -> None:
        await self.client.aclose()
