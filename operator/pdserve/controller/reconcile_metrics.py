"""The operator's own Prometheus metrics about its work queue and passes, as controller-runtime
users alert on them (served on --metrics-port beside the autoscaler's): passes by model and
result, their duration, the models waiting for a pass and how long they waited."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
