"""What the compiled data plane served, in this gateway's own series: it measures its requests as
this gateway measures what it serves (dataplane/metrics.go: requests by route and outcome, the
latency to the end and to the first token, the gaps between streamed chunks, each render and
derender call per render server) and reports the cumulative counts in /stats; they are added
here, so `/metrics` counts every request whoever served it, and the render autoscaler's busy time
includes the render calls the data plane made. The data plane is this process's child and lives
as long as it, so its cumulative counts only grow."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

ROUTES = {"pd": "openai_pd", "decode": "aggregated", "render_pd": "render_pd",
          "render_decode": "render"}  # fmt: skip
"""The data plane's route names -> this gateway's `route` label (Exchange.route)."""


@dataclass(frozen=True)
class Counts:
    """One label set of a data plane histogram: per-bucket counts (the last past every bound)."""

    buckets: tuple[int, ...]
    total: float


class WithDataPlane:
    """A histogram of this gateway's, collected with the data plane's counts added (a Prometheus
    collector standing in for the histogram in the registry)."""

    def __init__(
        self,
        own: Histogram,
        labelnames: Iterable[str],
        bounds: Iterable[float],
        registry: CollectorRegistry,
    ) -> None:
        self.own, self.labelnames, self.bounds = own, tuple(labelnames), tuple(bounds)
        self.extra: dict[tuple[str, ...], Counts] = {}
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        for family in self.own.collect():
            yield self._merged(family)

    def _merged(self, family: Metric) -> Metric:
        values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        for labels, counts in self.extra.items():
            named = dict(zip(self.labelnames, labels, strict=True))
            cumulative = 0
            bounds = [*map(floatToGoString, self.bounds), "+Inf"]
            for le, count in zip(bounds, counts.buckets, strict=True):
                cumulative += count
                key = (f"{family.name}_bucket", tuple(sorted({**named, "le": le}.items())))
                values[key] = values.get(key, 0.0) + cumulative
            for suffix, value in (("_count", cumulative), ("_sum", counts.total)):
                key = (f"{family.name}{suffix}", tuple(sorted(named.items())))
                values[key] = values.get(key, 0.0) + value
        merged = Metric(family.name, family.documentation, family.type, family.unit)
        merged.samples = [
            Sample(name, dict(labels), value) for (name, labels), value in values.items()
        ]
        return merged

    def fold(self, reported: Iterable[Mapping[str, Any]], label: Mapping[str, str]) -> None:
        """The data plane's histograms (`labels`, `counts`, `sum`), its label values translated
        by `label` (those it does not name are kept as they are)."""
        extra: dict[tuple[str, ...], Counts] = {}
        for each in reported:
            labels = tuple(label.get(v, v) for v in each.get("labels") or ())
            buckets = tuple(int(c) for c in each.get("counts") or ())
            if len(buckets) != len(self.bounds) + 1 or len(labels) != len(self.labelnames):
                continue  # another binary's buckets: not this histogram's
            before = extra.get(labels)
            if before is not None:  # two of its label values translated to one of ours
                buckets = tuple(a + b for a, b in zip(before.buckets, buckets, strict=True))
            extra[labels] = Counts(
                buckets, float(each.get("sum") or 0.0) + (before.total if before else 0.0)
            )
        self.extra = extra


class DataPlaneCounts:
    """Folds the data plane's request counts into this gateway's `requests` counter by delta."""

    def __init__(self, requests: Counter) -> None:
        self.requests = requests
        self.seen: dict[tuple[str, str], float] = {}

    def fold(self, reported: Iterable[Mapping[str, Any]]) -> None:
        for each in reported:
            key = (
                ROUTES.get(str(each.get("route")), str(each.get("route"))),
                str(each.get("outcome")),
            )
            total = float(each.get("count") or 0)
            delta = total - self.seen.get(key, 0.0)
            if delta > 0:
                self.requests.labels(*key).inc(delta)
                self.seen[key] = total
