"""Continuous KV transport health: the operator scrapes decode engines' NIXL metrics
(vllm:nixl_xfer_time_seconds, vllm:nixl_num_failed_transfers, vllm:nixl_num_kv_expired_reqs) in
the background and judges each model's transfers over the last interval against a budget
derived from its TTFT SLO. Reconcile reads the cached verdict into TransportHealthy."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.contract.metrics import GATEWAY_PD_DEGRADED, GATEWAY_PD_RECENT_FAILURES
from pdserve.controller.scraper import Key, PeriodicScraper
from pdserve.vllm.metrics import TransferCounters, parse_engine_transfer_counters, sum_samples

log = logging.getLogger("pdserve.health")
# Share of the TTFT SLO a KV handoff may take: prefill and decode's first step need the rest.
TRANSFER_SHARE_OF_TTFT = 0.5
GATEWAY_STATE = {GATEWAY_PD_DEGRADED: "degraded", GATEWAY_PD_RECENT_FAILURES: "failures"}


@dataclass(frozen=True)
class HealthVerdict:
    healthy: bool | None
    reason: str
    message: str
    # Measured over the window: average KV transfer and decode queueing, seconds.
    transfer_seconds: float | None = field(default=None, compare=False)
    queue_seconds: float | None = field(default=None, compare=False)


def transfer_budget_seconds(dm: DisaggregatedModel) -> float | None:
    ttft_ms = dm.spec.gateway.slo.ttft_ms
    return None if ttft_ms is None else ttft_ms / 1000 * TRANSFER_SHARE_OF_TTFT


def judge_health(window: TransferCounters, budget: float | None) -> HealthVerdict | None:
    """None: nothing happened in the window (keep the last verdict)."""
    if window.transfers == 0 and window.failed == 0 and window.expired == 0:
        return None
    average = window.seconds / window.transfers if window.transfers else None
    queueing = window.queue_seconds / window.queued if window.queued else None
    measured = {"transfer_seconds": average, "queue_seconds": queueing}
    numbers = f"{int(window.transfers)} transfers"
    if average is not None:
        numbers += f", average {average * 1000:.0f} ms"
    if budget is not None:
        numbers += f" (budget {budget * 1000:.0f} ms: half the TTFT SLO)"
    if window.failed:
        message = f"{int(window.failed)} failed KV transfers; {numbers}"
        return HealthVerdict(False, "TransferFailures", message, **measured)
    if window.expired:
        return HealthVerdict(False, "LeasesExpiring",
                             f"{int(window.expired)} KV leases expired before decode pulled "
                             f"them (raise kvTransfer.leaseDurationSeconds or add decode "
                             f"capacity); {numbers}", **measured)  # fmt: skip
    if average is not None and budget is not None and average > budget:
        return HealthVerdict(False, "SlowTransfers", numbers, **measured)
    return HealthVerdict(True, "Healthy", numbers, **measured)


VLLM_DEFAULT_LEASE_SECONDS = 30  # kv_lease_duration when the spec leaves it unset
LEASE_HEADROOM = 2.0  # the lease should cover twice the measured queueing + transfer


def kv_policy(
    dm: DisaggregatedModel, verdict: HealthVerdict | None
) -> tuple[bool | None, str, str]:
    """Whether the KV lease fits the TTFT SLO and what the engines measure: a lease that runs
    out before decode pulls makes prefill's work wasted (expired leases, recomputed prefixes)."""
    kv = dm.spec.kv_transfer
    if not dm.spec.disaggregated or not kv.connector.value.startswith("Nixl"):
        return None, "NoLease", "no NIXL KV leases: serving is aggregated or not over NIXL"
    lease = kv.lease_duration_seconds or VLLM_DEFAULT_LEASE_SECONDS
    field_name = "kvTransfer.leaseDurationSeconds"
    setting = f"{field_name} {lease} s" + ("" if kv.lease_duration_seconds else " (vLLM default)")
    problems = []
    ttft_ms = dm.spec.gateway.slo.ttft_ms
    if ttft_ms is not None and lease < ttft_ms / 1000:
        problems.append(f"{setting} is shorter than the TTFT SLO ({ttft_ms / 1000:g} s): a "
                        "request can meet its SLO and still lose its KV")  # fmt: skip
    measured = ""
    if verdict is not None and verdict.transfer_seconds is not None:
        expected = verdict.transfer_seconds + (verdict.queue_seconds or 0.0)
        measured = (f"measured decode queueing {verdict.queue_seconds or 0.0:.2f} s + transfer "
                    f"{verdict.transfer_seconds:.2f} s")  # fmt: skip
        if lease < LEASE_HEADROOM * expected:
            problems.append(f"{setting} is less than {LEASE_HEADROOM:g}x the {measured}; raise "
                            f"{field_name} or add decode capacity")  # fmt: skip
    if problems:
        return False, "LeaseTooShort", "; ".join(problems)
    return True, "Consistent", f"{setting}" + (f" covers the {measured}" if measured else "")


# Where a verdict names the engines that failed: the worst few, by their count in the window.
NAMED_ENGINES = 3
Engine = tuple[str, str]
"""A decode server's /metrics URL and one engine of it (its `engine` label: the global
data-parallel rank)."""


def where_failing(
    verdict: HealthVerdict,
    windows: Mapping[Engine, TransferCounters],
    names: Mapping[str, str],
) -> HealthVerdict:
    """A failing verdict with the decode engines its failures (or expired leases) came from: a
    rank's NIXL agent pulls on its own path (its GPU's NIC), so one bad rail shows on one rank."""
    counted = {"TransferFailures": "failed", "LeasesExpiring": "expired"}.get(verdict.reason)
    if counted is None:
        return verdict
    engines_of: dict[str, int] = {}
    for url, _ in windows:
        engines_of[url] = engines_of.get(url, 0) + 1
    found = sorted(
        ((int(getattr(window, counted)), url, engine) for (url, engine), window in windows.items()
         if getattr(window, counted) > 0),
        key=lambda item: (-item[0], item[1], item[2]),
    )  # fmt: skip
    if not found:
        return verdict
    named = []
    for number, url, engine in found[:NAMED_ENGINES]:
        pod = names.get(url, url)
        rank = f" rank {engine}" if engine and engines_of[url] > 1 else ""
        named.append(f"{pod}{rank} ({number})")
    more = f" and {len(found) - NAMED_ENGINES} more" if len(found) > NAMED_ENGINES else ""
    return dataclasses.replace(
        verdict, message=f"{verdict.message}; {counted} on decode {', '.join(named)}{more}"
    )


@dataclass
class _Tracked:
    urls: list[str]
    budget: float | None
    gateways: list[str] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # URL -> the pod's name
    last: TransferCounters | None = None
    last_by_engine: dict[Engine, TransferCounters] = field(default_factory=dict)
    verdict: HealthVerdict | None = None  # from the engines' metrics
    gateway_fallback: str | None = None  # gateways that route everything local, in words


class TransportMonitor(PeriodicScraper):
    """Scrapes the decode engines of every tracked model every `interval` seconds."""

    def __init__(self, on_change: Callable[[Key], None], **options: Any) -> None:
        super().__init__(on_change, **options)
        self.tracked: dict[Key, _Tracked] = {}

    def track(
        self,
        key: Key,
        urls: Sequence[str],
        budget: float | None,
        gateways: Sequence[str] = (),
        names: Mapping[str, str] | None = None,
    ) -> None:
        """`urls`: decode engines' /metrics; `gateways`: the model's gateway base URLs, whose
        /metrics say whether Auto mode degraded P/D to local prefill; `names`: a URL's pod."""
        entry = self.tracked.get(key)
        if entry is None:
            entry = self.tracked[key] = _Tracked(list(urls), budget)
        entry.urls, entry.budget, entry.gateways = list(urls), budget, list(gateways)
        entry.names = dict(names or {})

    def forget(self, key: Key) -> None:
        self.tracked.pop(key, None)

    def verdict(self, key: Key) -> HealthVerdict | None:
        """The gateways' fallback when they route everything local, else the engines' verdict."""
        entry = self.tracked.get(key)
        if entry is None:
            return None
        if entry.gateway_fallback is not None:
            engines = entry.verdict
            return HealthVerdict(
                False, "GatewayFallback", entry.gateway_fallback,
                transfer_seconds=engines.transfer_seconds if engines else None,
                queue_seconds=engines.queue_seconds if engines else None,
            )  # fmt: skip
        return entry.verdict

    async def _gateway_state(self, url: str) -> dict[str, float] | None:
        """A gateway's Auto-mode state from its /metrics (open without the API key)."""
        text = await self.fetch_text(f"{url}/metrics")
        if text is None:
            return None
        try:
            return sum_samples(text, lambda name, _: GATEWAY_STATE.get(name))
        except ValueError:
            return None

    async def _gateway_fallback(self, gateways: list[str]) -> str | None:
        states = [s for s in await asyncio.gather(*map(self._gateway_state, gateways)) if s]
        degraded = [s for s in states if s.get("degraded")]
        if not degraded:
            return None
        failures = sum(int(s.get("failures", 0)) for s in degraded)
        return (
            f"{len(degraded)} of {len(states)} gateway replicas prefill everything locally: "
            f"{failures} recent P/D handoff failures (failed or expired transfers, handoffs over "
            "the TTFT budget); they probe P/D and recover on their own"
        )

    async def _fetch(self, url: str) -> dict[str, TransferCounters] | None:
        text = await self.fetch_text(url)
        try:
            return None if text is None else parse_engine_transfer_counters(text)
        except ValueError as error:
            log.debug("%s: unreadable metrics: %s", url, error)
            return None

    async def scrape_once(self) -> None:
        for key, entry in list(self.tracked.items()):
            fallback = await self._gateway_fallback(entry.gateways) if entry.gateways else None
            if fallback != entry.gateway_fallback:
                entry.gateway_fallback = fallback
                self.on_change(key)
            if not entry.urls:
                continue
            results = await asyncio.gather(*(self._fetch(u) for u in entry.urls))
            engines = {
                (url, engine): counters
                for url, found in zip(entry.urls, results, strict=True) if found is not None
                for engine, counters in found.items()
            }  # fmt: skip
            if not any(found is not None for found in results):
                verdict: HealthVerdict | None = HealthVerdict(
                    None, "MetricsUnreachable",
                    f"none of {len(entry.urls)} decode engines answered on /metrics",
                )  # fmt: skip
            else:
                total = sum(engines.values(), TransferCounters())
                verdict = judge_health(total.since(entry.last), entry.budget)
                windows = {e: c.since(entry.last_by_engine.get(e)) for e, c in engines.items()}
                if verdict is not None and verdict.healthy is False:
                    verdict = where_failing(verdict, windows, entry.names)
                entry.last, entry.last_by_engine = total, engines
            if verdict is not None and verdict != entry.verdict:
                entry.verdict = verdict
                self.on_change(key)
