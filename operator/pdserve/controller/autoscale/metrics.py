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
        self.max_replicas = Gauge(
            "pdserve_operator_autoscale_max_replicas",
            "The most replicas (or active slices) the Builtin autoscaler may hold per pool "
            "(maxReplicas)",
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
        self._pools: dict[tuple[str, str], set[str]] = {}  # (namespace, model) -> pools shown

    def show(self, namespace: str, model: str, pool: str, replicas: int, most: int) -> None:
        """The replicas a pool is held at and the most it may have."""
        self.replicas.labels(namespace, model, pool).set(replicas)
        self.max_replicas.labels(namespace, model, pool).set(most)
        self._pools.setdefault((namespace, model), set()).add(pool)

    def forget(self, namespace: str, model: str) -> None:
        """No longer autoscaled (deleted, or no Builtin pool left): its held replicas, bounds and
        recommendations go, or an alert on them would never resolve."""
        for pool in self._pools.pop((namespace, model), ()):
            for gauge in (self.replicas, self.max_replicas, self.recommended):
                gauge.remove(namespace, model, pool)

    def forget_models(self) -> None:
        """This replica stopped leading: what it held would go stale."""
        for gauge in (self.replicas, self.max_replicas, self.recommended, self.signal):
            gauge.clear()
        self._pools.clear()
