"""The operator's own Prometheus metrics about its Builtin scaling decisions (served on
--metrics-port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


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
