"""The Builtin autoscaling engine: pure decision rules (metrics and clock injected) and the
background loop that scrapes pods' /metrics for them, like controller/health.py.

Rules (each returns a raw recommendation; `decide` then applies bounds, stabilization windows,
steps and cooldowns, the same semantics as the HPA behaviour pdserve writes for render):
- render: parser busy seconds per second (the render servers' render/derender handler time, or
  the gateways' own per-replica call time when higher: it includes queueing) against workers x
  targetParserBusyPercent, and CPU against the request x targetCPUUtilizationPercentage (the
  floor); the higher need wins.
- prefill: (arriving prompt tokens/s + queued prompt tokens / half the TTFT SLO) over the
  measured prefill throughput per replica x targetUtilizationPercent; one more replica while
  the engines' own TTFT runs over the SLO.
- decode: KV-cache usage against targetUtilizationPercent and mean ITL against the ITL SLO.
- slices: whole slices, enough for both pools' recommendations (P:D and domains hold).

Reconcile asks `Autoscaler.plan` for the replicas to build with: the live counts, or a newer
decision (announced once as an Event). Decisions are operator metrics too."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.api import DisaggregatedModel
from pdserve.api.autoscaling import EngineAutoscaler, RenderAutoscaler, ScalingBehaviour
from pdserve.api.requirements import cpu_cores
from pdserve.builders.scaling import (
    ReplicaPlan,
    active_slices,
    builtin_slices,
    render_replicas,
)
from pdserve.contract.metrics import GATEWAY_RENDER_CALL_SECONDS_SUM, RENDER_POD_LABEL
from pdserve.contract.names import COMPONENT_LABEL, ENGINE_PORT, SLICE_LABEL, Component
from pdserve.controller.scraper import Key, PeriodicScraper
from pdserve.vllm import metrics
from pdserve.vllm.metrics import Selector, Totals, sum_samples

log = logging.getLogger("pdserve.autoscale")
TOLERANCE = 0.1  # as the HPA: no change while the load is within 10% of the target
QUEUE_SHARE_OF_TTFT = 0.5  # queued prompts must drain within half the TTFT SLO
RENDER_PATHS = (
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
)


# ---- metrics of one scrape ---------------------------------------------------------------------
def render_series(name: str, labels: Mapping[str, str]) -> str | None:
    """A render server: its render/derender handler time and its CPU."""
    if name == "http_request_duration_seconds_sum" and labels.get("handler") in RENDER_PATHS:
        return "busy"
    if name == "process_cpu_seconds_total":
        return "cpu"
    return None


def gateway_series(name: str, labels: Mapping[str, str]) -> str | None:
    """A gateway: its call time per render replica (`busy:<pod>`)."""
    if name == GATEWAY_RENDER_CALL_SECONDS_SUM:
        return f"busy:{labels.get(RENDER_POD_LABEL, '')}"
    return None


ENGINE_SERIES = {
    **dict.fromkeys(metrics.counter_samples(metrics.PROMPT_TOKENS), "prompt_tokens"),
    metrics.total(metrics.REQUEST_PREFILL_TIME): "prefill_seconds",
    metrics.total(metrics.REQUEST_PROMPT_TOKENS): "prompt_lengths",
    metrics.count(metrics.REQUEST_PROMPT_TOKENS): "prompts",
    metrics.NUM_REQUESTS_WAITING: "waiting",
    metrics.KV_CACHE_USAGE: "kv_usage",
    metrics.total(metrics.INTER_TOKEN_LATENCY): "itl_seconds",
    metrics.count(metrics.INTER_TOKEN_LATENCY): "itl_count",
    metrics.total(metrics.TIME_TO_FIRST_TOKEN): "ttft_seconds",
    metrics.count(metrics.TIME_TO_FIRST_TOKEN): "ttft_count",
}
GAUGES = frozenset({"waiting", "kv_usage"})


def engine_series(name: str, labels: Mapping[str, str]) -> str | None:
    return ENGINE_SERIES.get(name)


# ---- raw recommendations -----------------------------------------------------------------------
@dataclass(frozen=True)
class Recommendation:
    replicas: int
    reason: str
    signals: dict[str, float] = field(default_factory=dict)


def proportional(current: int, ratio: float) -> int:
    """current x ratio rounded up, unchanged within the tolerance."""
    if abs(ratio - 1.0) <= TOLERANCE:
        return current
    return max(1, math.ceil(current * ratio - 1e-9))


def recommend_render(
    current: int,
    busy: Sequence[float],
    cpu: Sequence[float],
    *,
    workers: int,
    cpu_request: float | None,
    target_busy: float,
    target_cpu: float,
) -> Recommendation | None:
    """`busy` and `cpu`: seconds per second of each render pod with metrics (a pod's busy is the
    higher of the server's and the gateways' view). None: no pod reported."""
    if not busy:
        return None
    per_pod_busy = workers * target_busy
    ratio_busy = sum(busy) / (current * per_pod_busy)
    ratios = {"busy": ratio_busy}
    if cpu and cpu_request:
        ratios["cpu"] = sum(cpu) / (current * cpu_request * target_cpu)
    signal, ratio = max(ratios.items(), key=lambda item: item[1])
    wanted = proportional(current, ratio)
    reason = (
        f"parser busy {sum(busy):.2f} s/s over {len(busy)} pods (target {per_pod_busy:.2f} per pod)"
    )
    if "cpu" in ratios:
        reason += f", CPU {sum(cpu):.2f} cores (target {target_cpu:.0%} of {cpu_request:g})"
    if signal == "cpu" and wanted != current:
        reason += ": CPU asks for more"
    return Recommendation(wanted, reason, {"busy": sum(busy), "cpu": sum(cpu), "ratio": ratio})


def recommend_prefill(
    current: int,
    *,
    token_rate: float,
    queued_tokens: float,
    throughput: float | None,
    ttft_slo: float,
    target: float,
    ttft: float | None = None,
) -> Recommendation | None:
    """`token_rate`: prompt tokens/s the pool prefilled; `queued_tokens`: prompt tokens
    waiting now; `throughput`: prompt tokens one replica prefills per busy second (None: not
    measured yet); `ttft`: mean TTFT the engines measured in the window."""
    if throughput is None or throughput <= 0:
        return None
    budget = ttft_slo * QUEUE_SHARE_OF_TTFT
    need = (token_rate + queued_tokens / budget) / (throughput * target)
    wanted = max(1, math.ceil(need - 1e-9))
    if abs(need / current - 1.0) <= TOLERANCE:
        wanted = current
    reason = (
        f"{token_rate:.0f} prompt tokens/s + {queued_tokens:.0f} queued (to drain in "
        f"{budget:g} s) over {throughput:.0f} tokens/s per replica at {target:.0%}"
    )
    if ttft is not None and ttft > ttft_slo and wanted <= current:
        wanted = current + 1
        reason += f"; TTFT {ttft * 1000:.0f} ms over the SLO {ttft_slo * 1000:.0f} ms"
    return Recommendation(
        wanted,
        reason,
        {"token_rate": token_rate, "queued_tokens": queued_tokens, "throughput": throughput},
    )


def recommend_decode(
    current: int,
    *,
    kv_usage: float | None,
    itl: float | None,
    itl_slo: float | None,
    target_kv: float,
) -> Recommendation | None:
    """`kv_usage`: mean KV-cache use (0-1) of the decode pods; `itl`: mean inter-token latency
    in the window (None: no tokens)."""
    if kv_usage is None:
        return None
    ratios = {"kv": kv_usage / target_kv}
    reason = f"KV cache {kv_usage:.0%} (target {target_kv:.0%})"
    if itl is not None and itl_slo is not None:
        ratios["itl"] = itl / itl_slo
        reason += f", ITL {itl * 1000:.0f} ms (SLO {itl_slo * 1000:.0f} ms)"
    ratio = max(ratios.values())
    signals = {"kv_usage": kv_usage, "ratio": ratio}
    if itl is not None:
        signals["itl"] = itl
    return Recommendation(proportional(current, ratio), reason, signals)


def slices_for(wanted: Mapping[str, int], per_slice: Mapping[str, int]) -> int:
    """Whole slices covering every pool's recommendation."""
    return max(math.ceil(wanted[pool] / per_slice[pool]) for pool in wanted)


# ---- behaviour: bounds, windows, steps, cooldowns ----------------------------------------------
@dataclass(frozen=True)
class Behaviour:
    min_replicas: int
    max_replicas: int
    up_window: float
    down_window: float
    up_step: int
    down_step: int
    cooldown: float

    @classmethod
    def of(cls, spec: ScalingBehaviour, bounds: tuple[int, int] | None = None) -> Behaviour:
        low, high = bounds or (spec.min_replicas, spec.max_replicas)
        return cls(
            low, high, spec.scale_up_stabilization_seconds,
            spec.scale_down_stabilization_seconds, spec.scale_up_step, spec.scale_down_step,
            spec.cooldown_seconds,
        )  # fmt: skip

    def strictest(self, other: Behaviour) -> Behaviour:
        """The more conservative of two (slices follow both pools' settings)."""
        return Behaviour(
            self.min_replicas, self.max_replicas, max(self.up_window, other.up_window),
            max(self.down_window, other.down_window), min(self.up_step, other.up_step),
            min(self.down_step, other.down_step), max(self.cooldown, other.cooldown),
        )  # fmt: skip


@dataclass(frozen=True)
class ScalerState:
    """What `decide` remembers between calls: recent recommendations and the last steps."""

    history: tuple[tuple[float, int], ...] = ()
    last_up: float | None = None
    last_down: float | None = None
    started: float | None = None  # the first recommendation: a window must be filled first


@dataclass(frozen=True)
class Decision:
    replicas: int
    current: int
    reason: str

    @property
    def direction(self) -> str:
        if self.replicas > self.current:
            return "up"
        return "down" if self.replicas < self.current else "hold"


def throughout(window: float) -> str:
    return f" throughout {window:g} s" if window else ""


def decide(
    current: int, recommended: int, now: float, state: ScalerState, behaviour: Behaviour
) -> tuple[Decision, ScalerState]:
    """HPA semantics: a scale-up goes to the lowest recommendation of the up window, a
    scale-down to the highest of the down window (so brief swings change nothing), and only once
    a whole window has been observed (after a restart too); then at most one step per direction
    per cooldown; then the bounds, which always hold."""
    horizon = max(behaviour.up_window, behaviour.down_window)
    kept = [h for h in state.history if now - h[0] <= horizon]
    history = (*kept, (now, recommended))
    started = now if state.started is None else state.started
    up = min(r for t, r in history if now - t <= behaviour.up_window)
    down = max(r for t, r in history if now - t <= behaviour.down_window)
    target, why = current, "within the stabilization windows"
    if up > current and now - started >= behaviour.up_window:
        target, why = up, f"recommended {up}" + throughout(behaviour.up_window)
    elif down < current and now - started >= behaviour.down_window:
        target, why = down, f"recommended at most {down}" + throughout(behaviour.down_window)
    state = replace(state, history=history, started=started)
    if target > current:
        if state.last_up is not None and now - state.last_up < behaviour.cooldown:
            target, why = current, f"scale-up cooldown ({behaviour.cooldown:g} s)"
        elif target > current + behaviour.up_step:
            target, why = current + behaviour.up_step, why + f"; {behaviour.up_step} per step"
    elif target < current:
        if state.last_down is not None and now - state.last_down < behaviour.cooldown:
            target, why = current, f"scale-down cooldown ({behaviour.cooldown:g} s)"
        elif target < current - behaviour.down_step:
            target, why = current - behaviour.down_step, why + f"; {behaviour.down_step} per step"
    bounded = max(behaviour.min_replicas, min(behaviour.max_replicas, target))
    if bounded != target:
        why += f"; bounded to {behaviour.min_replicas}-{behaviour.max_replicas}"
    if bounded > current:
        state = replace(state, last_up=now)
    elif bounded < current:
        state = replace(state, last_down=now)
    return Decision(bounded, current, why), state


# ---- what the operator tracks per model --------------------------------------------------------
POOLS = ("render", "prefill", "decode", "slices")


def live_plan(dm: DisaggregatedModel, workloads: Iterable[Mapping[str, Any]]) -> ReplicaPlan:
    """The replica counts the live objects hold for Builtin-scaled pools (restart-safe: the
    cluster is the memory). Active slices: those whose StatefulSets run pods."""
    values: dict[str, int] = {}
    active: set[str] = set()
    sliced = builtin_slices(dm)
    for obj in workloads:
        component = obj["metadata"].get("labels", {}).get(COMPONENT_LABEL)
        replicas = obj.get("spec", {}).get("replicas")
        if component not in ("render", "prefill", "decode") or replicas is None:
            continue
        if sliced and component != "render":
            slice_label = obj["spec"].get("template", {}).get("metadata", {}).get("labels", {})
            if int(replicas) > 0:
                active.add(str(slice_label.get(SLICE_LABEL, "0")))
            continue
        values[component] = values.get(component, 0) + int(replicas)
    return ReplicaPlan(
        render=values.get("render"), prefill=values.get("prefill"), decode=values.get("decode"),
        slices=len(active) if sliced and active else None,
    )  # fmt: skip


def built_plan(dm: DisaggregatedModel, plan: ReplicaPlan) -> ReplicaPlan:
    """What the builders will write for Builtin pools (the plan clamped into the bounds)."""
    render = None
    scaling = dm.spec.render.autoscaling
    if dm.spec.render.enabled and scaling.enabled and scaling.engine is RenderAutoscaler.builtin:
        render = render_replicas(dm, plan)
    engines: dict[str, int | None] = {"prefill": None, "decode": None}
    slices = None
    if builtin_slices(dm):
        slices = active_slices(dm, plan)
    else:
        for name, pool in dm.spec.engine_pools():
            auto = pool.autoscaling
            if auto is not None and auto.engine is EngineAutoscaler.builtin:
                chosen = getattr(plan, name)
                start = pool.replicas if chosen is None else chosen
                engines[name] = max(auto.min_replicas, min(auto.max_replicas, start))
    return ReplicaPlan(render, engines["prefill"], engines["decode"], slices)


@dataclass
class Targets:
    """The metrics URLs of one model's pods, by pool and pod name."""

    render: dict[str, str] = field(default_factory=dict)
    gateway: dict[str, str] = field(default_factory=dict)
    prefill: dict[str, str] = field(default_factory=dict)
    decode: dict[str, str] = field(default_factory=dict)


TargetResolver = Callable[[Mapping[str, Any]], str | None]


def pod_metrics_url(pod: Mapping[str, Any]) -> str | None:
    """Every pdserve pod serves /metrics on its HTTP port (8000)."""
    ip = pod.get("status", {}).get("podIP")
    return f"http://{ip}:{ENGINE_PORT}/metrics" if ip else None


def targets_of(pods: Iterable[Mapping[str, Any]], resolve: TargetResolver) -> Targets:
    found = Targets()
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        url = resolve(pod)
        component = pod["metadata"].get("labels", {}).get(COMPONENT_LABEL)
        if url is None:
            continue
        pools = (Component.render, Component.gateway, Component.prefill, Component.decode)
        if component in {c.value for c in pools}:
            getattr(found, component)[pod["metadata"]["name"]] = url
    return found


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


class AutoscaleMetrics:
    """The operator's own metrics about its scaling decisions."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["namespace", "model", "pool"]
        self.replicas = Gauge(
            "pdserve_operator_autoscale_replicas",
            "Replicas (or active slices) the Builtin autoscaler holds per pool",
            labels,
            registry=self.registry,
        )
        self.recommended = Gauge(
            "pdserve_operator_autoscale_recommendation",
            "The raw recommendation before windows, steps, cooldowns and bounds",
            labels,
            registry=self.registry,
        )
        self.signal = Gauge(
            "pdserve_operator_autoscale_signal",
            "Signals behind the last recommendation (busy, cpu, kv_usage, itl, token_rate, ...)",
            [*labels, "signal"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "pdserve_operator_autoscale_decisions",
            "Scaling decisions by direction",
            [*labels, "direction"],
            registry=self.registry,
        )


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

    # ---- the loop -------------------------------------------------------------------------------
    async def _fetch(self, url: str, select: Selector) -> Totals | None:
        text = await self.fetch_text(url)
        if text is None:
            return None
        try:
            return sum_samples(text, select)
        except ValueError as error:
            log.debug("%s: unreadable metrics: %s", url, error)
            return None

    async def _windows(
        self, model: _Model, pods: Mapping[str, str], select: Selector
    ) -> list[tuple[str, float, Totals]]:
        """(pod, seconds, deltas) of every pod that answered now and at the previous scrape."""
        names = sorted(pods)
        results = await asyncio.gather(*(self._fetch(pods[n], select) for n in names))
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
        engine_current = self._engine_current(dm, current)
        for name, pool in dm.spec.engine_pools():
            auto = pool.autoscaling
            if auto is None or auto.engine is not EngineAutoscaler.builtin:
                continue
            urls = getattr(model.targets, name)
            count = engine_current.get(name)
            if not urls or count is None:
                continue
            windows = await self._windows(model, urls, engine_series)
            if not windows:
                continue
            rec = (self._prefill if name == "prefill" else self._decode)(model, count, windows)
            if rec is not None:
                out[name] = rec
        if current.slices is not None:
            scaled = {n: p.replicas for n, p in dm.spec.engine_pools()}
            if set(scaled) <= set(out):
                wanted = {n: out[n].replicas for n in scaled}
                reason = "; ".join(f"{n}: {out[n].reason}" for n in scaled)
                out["slices"] = Recommendation(slices_for(wanted, scaled), reason)
        return out

    @staticmethod
    def _engine_current(dm: DisaggregatedModel, current: ReplicaPlan) -> dict[str, int | None]:
        if current.slices is not None:
            return {n: p.replicas * current.slices for n, p in dm.spec.engine_pools()}
        return {"prefill": current.prefill, "decode": current.decode}

    async def _render(self, model: _Model, current: int) -> Recommendation | None:
        render = model.dm.spec.render
        servers = await self._windows(model, model.targets.render, render_series)
        gateways = await self._windows(model, model.targets.gateway, gateway_series)
        seen: dict[str, float] = {}  # gateway view, busy s/s per render pod
        for _, seconds, deltas in gateways:
            for series, value in deltas.items():
                pod = series.removeprefix("busy:")
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
    def _sum(windows: Sequence[tuple[str, float, Totals]], key: str) -> float:
        return sum(deltas.get(key, 0.0) for _, _, deltas in windows)

    def _prefill(
        self, model: _Model, current: int, windows: Sequence[tuple[str, float, Totals]]
    ) -> Recommendation | None:
        dm = model.dm
        auto = dm.spec.prefill.autoscaling if dm.spec.prefill else None
        slo = dm.spec.gateway.slo.ttft_ms
        if auto is None or slo is None:
            return None
        seconds = max(s for _, s, _ in windows)
        tokens, busy = self._sum(windows, "prompt_tokens"), self._sum(windows, "prefill_seconds")
        if busy > 0 and tokens > 0:
            model.measured["prefill_throughput"] = tokens / busy
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
        self, model: _Model, current: int, windows: Sequence[tuple[str, float, Totals]]
    ) -> Recommendation | None:
        dm = model.dm
        auto = dm.spec.decode.autoscaling
        assert auto is not None
        kv = self._sum(windows, "kv_usage") / len(windows)
        count = self._sum(windows, "itl_count")
        itl = self._sum(windows, "itl_seconds") / count if count else None
        slo = dm.spec.gateway.slo.itl_ms
        return recommend_decode(
            current, kv_usage=kv, itl=itl, itl_slo=slo / 1000 if slo else None,
            target_kv=auto.target_utilization_percent / 100,
        )  # fmt: skip

    def _behaviour(self, dm: DisaggregatedModel, pool: str) -> Behaviour:
        if pool == "render":
            return Behaviour.of(dm.spec.render.autoscaling)
        if pool == "slices":
            merged: Behaviour | None = None
            for _, scaled in dm.spec.engine_pools():
                assert scaled.autoscaling is not None
                this = Behaviour.of(scaled.autoscaling, dm.spec.slice_bounds())
                merged = this if merged is None else merged.strictest(this)
            assert merged is not None
            return merged
        engine = dm.spec.prefill if pool == "prefill" else dm.spec.decode
        assert engine is not None
        assert engine.autoscaling is not None
        return Behaviour.of(engine.autoscaling)

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
            decision, model.states[pool] = decide(
                base, rec.replicas, self.clock(), model.states.get(pool, ScalerState()),
                self._behaviour(dm, pool),
            )  # fmt: skip
            self.metrics.replicas.labels(**labels).set(decision.replicas)
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
