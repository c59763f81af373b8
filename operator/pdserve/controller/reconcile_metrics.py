"""The operator's own Prometheus metrics about its work queue and passes, as controller-runtime
users alert on them (served on --metrics-port beside the autoscaler's): passes by model and
result, their duration, the models waiting for a pass and how long they waited; and per model
what its last pass found (its conditions, the parity drift it repaired), which the chart's
PrometheusRule alerts on."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.api.status import DisaggregatedModelStatus

Key = tuple[str, str]  # namespace, name

DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ReconcileMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.passes = Counter(
            "pdserve_operator_reconcile",
            "Reconcile passes by model and result (success, error: retried with backoff, "
            "crash: a defect, retried at the next event or resync)",
            ["namespace", "model", "result"],
            registry=registry,
        )
        self.duration = Histogram(
            "pdserve_operator_reconcile_duration_seconds",
            "How long one reconcile pass took, by result",
            ["result"],
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.depth = Gauge(
            "pdserve_operator_workqueue_depth",
            "Models waiting for a reconcile pass",
            registry=registry,
        )
        self.wait = Histogram(
            "pdserve_operator_workqueue_queue_duration_seconds",
            "How long a model waited from the event that asked for a pass to the pass's start",
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.conditions = Gauge(
            "pdserve_operator_model_condition",
            "1 for each condition of a model's status as its last pass computed it, with its "
            "status (True, False, Unknown) and reason (on the leader; none on a follower)",
            ["namespace", "model", "condition", "status", "reason"],
            registry=registry,
        )
        self.drift = Counter(
            "pdserve_operator_parity_drift",
            "Passes that found a child's parity fields edited and repaired them (ParityDrift)",
            ["namespace", "model"],
            registry=registry,
        )
        self._shown: dict[Key, list[tuple[str, str, str]]] = {}  # condition, status, reason

    def observe(self, key: Key, status: DisaggregatedModelStatus | None, drifts: int) -> None:
        """What one pass found: the conditions of `status` (None: the pass computed none, the
        last ones stay) and `drifts` parity drifts it repaired."""
        self.drift.labels(*key).inc(drifts)  # 0 too: the series exists before the first drift
        self._shown.setdefault(key, [])
        if status is None:
            return
        shown: list[tuple[str, str, str]] = [
            (c.type, c.status, c.reason) for c in status.conditions
        ]
        for gone in set(self._shown.get(key, ())) - set(shown):
            self.conditions.remove(*key, *gone)
        for labels in shown:
            self.conditions.labels(*key, *labels).set(1)
        self._shown[key] = shown

    def forget(self, key: Key) -> None:
        """The model is gone: its series too (an alert on it would never resolve)."""
        if key not in self._shown:
            return  # never observed (older prometheus_client raises removing none)
        for labels in self._shown.pop(key):
            self.conditions.remove(*key, *labels)
        self.drift.remove(*key)

    def forget_models(self) -> None:
        """This replica stopped leading: what it last saw of every model would go stale."""
        self.conditions.clear()
        self.drift.clear()
        self._shown.clear()
