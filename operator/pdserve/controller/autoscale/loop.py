"""The Builtin autoscaling loop: every `interval` seconds it scrapes the pods of every tracked
model, turns the windows of their metrics into signals and raw recommendations (rules), and
those into decisions (behaviour); a decision that changes replicas asks for a reconcile, which
builds with `Autoscaler.plan`. The clock is injected (`clock`), as the HTTP client is."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.api import DisaggregatedModel
from pdserve.api.autoscaling import EngineAutoscaler
from pdserve.api.requirements import cpu_cores
from pdserve.builders.scaling import ReplicaPlan
from pdserve.controller.autoscale.behaviour import Decision, ScalerState, behaviour_of, decide
from pdserve.controller.autoscale.metrics import AutoscaleMetrics
from pdserve.controller.autoscale.plans import POOLS, built_plan, engine_current
from pdserve.controller.autoscale.rules import (
    Recommendation,
    recommend_decode,
    recommend_prefill,
    recommend_render,
    slices_for,
)
from pdserve.controller.autoscale.series import (
    ENGINE_COUNTED,
    GATEWAY_BUSY_PREFIX,
    GAUGES,
    engine_series,
    gateway_series,
    render_series,
)
from pdserve.controller.autoscale.targets import (
    TargetResolver,
    Targets,
    pod_metrics_url,
    targets_of,
)
from pdserve.controller.scraper import Key, PeriodicScraper
from pdserve.vllm import metrics
from pdserve.vllm.metrics import Selector, Totals, samples_of, sum_samples

log = logging.getLogger("pdserve.autoscale")
Window = tuple[str, float, Totals]  # pod, seconds, deltas since its previous scrape


@dataclass
class _Model:
    dm: DisaggregatedModel
    targets: Targets
    current: ReplicaPlan
    samples: dict[str, tuple[float, Totals]] = field(default_factory=dict)  # pod -> (t, totals)
    states: dict[str, ScalerState] = field(default_factory=dict)
    decided: dict[str, Decision] = field(default_factory=dict)  # not yet live
    announced: set[str] = field(default_factory=set)
    measured: dict[str, float] = field(default_factory=dict)  # last known prefill throughput


class Autoscaler(PeriodicScraper):
    """Scrapes the pods of every Builtin-autoscaled model every `interval` seconds and decides;
    a decision that changes replicas triggers a reconcile (`on_change`)."""

    def __init__(
        self,
        on_change: Callable[[Key], None],
        *,
        interval: float = 15.0,
        timeout: float = 2.0,
        client: httpx.AsyncClient | None = None,
        resolve: TargetResolver = pod_metrics_url,
        clock: Callable[[], float] = time.monotonic,
        metrics: AutoscaleMetrics | None = None,
    ) -> None:
        super().__init__(on_change, interval=interval, timeout=timeout, client=client)
        self.resolve = resolve
        self.clock = clock
        self.metrics = metrics or AutoscaleMetrics()
        self.models: dict[Key, _Model] = {}

    # ---- called by reconcile --------------------------------------------------------------------
    def plan(
        self,
        key: Key,
        dm: DisaggregatedModel,
        current: ReplicaPlan,
        pods: Iterable[Mapping[str, Any]],
    ) -> tuple[ReplicaPlan, list[Decision]]:
        """The plan to build with (newer decisions over the live counts) and the decisions to
        announce (each once). Models without a Builtin pool are not tracked."""
        if built_plan(dm, current) == ReplicaPlan():
            self.forget(key)
            return current, []
        targets = targets_of(pods, self.resolve)
        model = self.models.get(key)
        if model is None:
            model = self.models[key] = _Model(dm, targets, current)
        model.dm, model.targets, model.current = dm, targets, current
        chosen = {pool: getattr(current, pool) for pool in POOLS}
        news: list[Decision] = []
        for pool, decision in list(model.decided.items()):
            if chosen[pool] == decision.replicas:
                del model.decided[pool]  # live now
                model.announced.discard(pool)
                continue
            chosen[pool] = decision.replicas
            if pool not in model.announced:
                model.announced.add(pool)
                news.append(decision)
        return ReplicaPlan(**chosen), news

    def forget(self, key: Key) -> None:
        self.models.pop(key, None)
        self.metrics.forget(*key)

    # ---- the loop -------------------------------------------------------------------------------
    async def _fetch(self, url: str, select: Selector, counted: frozenset[str]) -> Totals | None:
        text = await self.fetch_text(url)
        if text is None:
            return None
        try:
            return sum_samples(text, select, counted)
        except ValueError as error:
            log.debug("%s: unreadable metrics: %s", url, error)
            return None

    async def _windows(
        self,
        model: _Model,
        pods: Mapping[str, str],
        select: Selector,
        counted: frozenset[str] = frozenset(),
    ) -> list[Window]:
        """(pod, seconds, deltas) of every pod that answered now and at the previous scrape;
        with `counted`, how many samples each of those keys summed (sum_samples)."""
        names = sorted(pods)
        results = await asyncio.gather(*(self._fetch(pods[n], select, counted) for n in names))
        now = self.clock()
        out = []
        for name, totals in zip(names, results, strict=True):
            if totals is None:
                continue
            before = model.samples.get(name)
            model.samples[name] = (now, totals)
            if before is not None and now > before[0]:
                out.append((name, now - before[0], metrics.window(totals, before[1], GAUGES)))
        return out

    async def scrape_once(self) -> None:
        for key, model in list(self.models.items()):
            try:
                recommendations = await self._recommend(model)
            except Exception:  # one model's odd metrics must not stop the others
                log.exception("%s/%s: autoscaling failed", *key)
                continue
            changed = self._decide(key, model, recommendations)
            if changed:
                self.on_change(key)

    async def _recommend(self, model: _Model) -> dict[str, Recommendation]:
        dm, current = model.dm, built_plan(model.dm, model.current)
        out: dict[str, Recommendation] = {}
        if current.render is not None and model.targets.render:
            rec = await self._render(model, current.render)
            if rec is not None:
                out["render"] = rec
        engines = engine_current(dm, current)
        for name, pool in dm.spec.engine_pools():
            auto = pool.autoscaling
            if auto is None or auto.engine is not EngineAutoscaler.builtin:
                continue
            urls = getattr(model.targets, name)
            count = engines.get(name)
            if not urls or count is None:
                continue
            windows = await self._windows(model, urls, engine_series, ENGINE_COUNTED)
            if not windows:
                continue
            if name == "prefill":
                rec = self._prefill(model, count, windows, pool.nodes_per_replica)
            else:
                rec = self._decode(model, count, windows)
            if rec is not None:
                out[name] = rec
        if current.slices is not None:
            scaled = {n: p.replicas for n, p in dm.spec.engine_pools()}
            if set(scaled) <= set(out):
                wanted = {n: out[n].replicas for n in scaled}
                reason = "; ".join(f"{n}: {out[n].reason}" for n in scaled)
                out["slices"] = Recommendation(slices_for(wanted, scaled), reason)
        return out

    async def _render(self, model: _Model, current: int) -> Recommendation | None:
        render = model.dm.spec.render
        servers = await self._windows(model, model.targets.render, render_series)
        gateways = await self._windows(model, model.targets.gateway, gateway_series)
        seen: dict[str, float] = {}  # gateway view, busy s/s per render pod
        for _, seconds, deltas in gateways:
            for series, value in deltas.items():
                pod = series.removeprefix(GATEWAY_BUSY_PREFIX)
                seen[pod] = seen.get(pod, 0.0) + value / seconds
        busy, cpu = [], []
        for name, seconds, deltas in servers:
            own = deltas.get("busy", 0.0) / seconds
            busy.append(max(own, seen.get(name, 0.0)))
            if "cpu" in deltas:
                cpu.append(deltas["cpu"] / seconds)
        scaling = render.autoscaling
        return recommend_render(
            current, busy, cpu, workers=render.worker_count,
            cpu_request=cpu_cores(render.cpu_request),
            target_busy=scaling.target_parser_busy_percent / 100,
            target_cpu=scaling.target_cpu_utilization_percentage / 100,
        )  # fmt: skip

    @staticmethod
    def _sum(windows: Sequence[Window], key: str) -> float:
        return sum(deltas.get(key, 0.0) for _, _, deltas in windows)

    def _prefill(
        self, model: _Model, current: int, windows: Sequence[Window], pods_per_replica: int
    ) -> Recommendation | None:
        dm = model.dm
        auto = dm.spec.prefill.autoscaling if dm.spec.prefill else None
        slo = dm.spec.gateway.slo.ttft_ms
        if auto is None or slo is None:
            return None
        seconds = max(s for _, s, _ in windows)
        tokens, busy = self._sum(windows, "prompt_tokens"), self._sum(windows, "prefill_seconds")
        if busy > 0 and tokens > 0:
            # Prefill seconds add up over the data-parallel ranks, which prefill side by side:
            # a replica (a pod, or a group of pods) prefills as fast as all its ranks.
            ranks = self._sum(windows, samples_of("prefill_seconds")) / len(windows)
            per_replica = max(1.0, ranks) * pods_per_replica
            model.measured["prefill_throughput"] = tokens / busy * per_replica
        prompts = self._sum(windows, "prompts")
        if prompts:
            model.measured["prompt_length"] = self._sum(windows, "prompt_lengths") / prompts
        queued = self._sum(windows, "waiting") * model.measured.get("prompt_length", 0.0)
        ttft_count = self._sum(windows, "ttft_count")
        ttft = self._sum(windows, "ttft_seconds") / ttft_count if ttft_count else None
        return recommend_prefill(
            current, token_rate=tokens / seconds, queued_tokens=queued,
            throughput=model.measured.get("prefill_throughput"), ttft_slo=slo / 1000,
            target=auto.target_utilization_percent / 100, ttft=ttft,
        )  # fmt: skip

    def _decode(
        self, model: _Model, current: int, windows: Sequence[Window]
    ) -> Recommendation | None:
        dm = model.dm
        auto = dm.spec.decode.autoscaling
        assert auto is not None
        # The mean over every data-parallel rank of every pod: each reports its own cache.
        ranks = self._sum(windows, samples_of("kv_usage"))
        kv = self._sum(windows, "kv_usage") / (ranks or len(windows))
        count = self._sum(windows, "itl_count")
        itl = self._sum(windows, "itl_seconds") / count if count else None
        slo = dm.spec.gateway.slo.itl_ms
        return recommend_decode(
            current, kv_usage=kv, itl=itl, itl_slo=slo / 1000 if slo else None,
            target_kv=auto.target_utilization_percent / 100,
        )  # fmt: skip

    def _decide(
        self, key: Key, model: _Model, recommendations: Mapping[str, Recommendation]
    ) -> bool:
        dm = model.dm
        current = built_plan(dm, model.current)
        changed = False
        for pool, rec in recommendations.items():
            live = getattr(current, pool)
            if live is None or (pool in ("prefill", "decode") and current.slices is not None):
                continue
            labels = {"namespace": key[0], "model": key[1], "pool": pool}
            self.metrics.recommended.labels(**labels).set(rec.replicas)
            for name, value in rec.signals.items():
                self.metrics.signal.labels(**labels, signal=name).set(value)
            pending = model.decided.get(pool)
            base = pending.replicas if pending is not None else live
            behaviour = behaviour_of(dm, pool)
            decision, model.states[pool] = decide(
                base, rec.replicas, self.clock(), model.states.get(pool, ScalerState()), behaviour
            )
            self.metrics.show(*key, pool, decision.replicas, behaviour.max_replicas)
            if decision.replicas == base:
                continue
            self.metrics.decisions.labels(**labels, direction=decision.direction).inc()
            unit = "slices" if pool == "slices" else f"{pool} replicas"
            message = f"{unit} {live} -> {decision.replicas}: {rec.reason} ({decision.reason})"
            model.decided[pool] = Decision(decision.replicas, live, message)
            model.announced.discard(pool)
            log.info("%s/%s: %s", *key, message)
            changed = True
        return changed
