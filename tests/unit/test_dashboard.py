"""The chart's Grafana dashboard queries only metrics that exist: pdserve's gateway metrics and
vLLM's engine metrics (both from the code's own registries), plus the few kube-state-metrics
and cAdvisor series named below; its panels cover issue 8's list; its variables filter every
query by namespace and model."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.gateway.metrics import LATENCY, GatewayMetrics
from pdserve.sim.engine_metrics import EngineMetrics

CHART = Path(__file__).resolve().parents[2] / "charts" / "pdserve"
DASHBOARD = CHART / "dashboards" / "pdserve.json"

# Not pdserve's: the cluster's exporters. kube-state-metrics (replicas) and the kubelet's
# cAdvisor (container CPU), under the names they have had since kube-state-metrics 2.0.
KUBE_STATE_METRICS = {
    "kube_deployment_spec_replicas",
    "kube_deployment_status_replicas_available",
    "kube_statefulset_status_replicas_ready",
    "kube_horizontalpodautoscaler_status_desired_replicas",
}
CADVISOR = {"container_cpu_usage_seconds_total"}

SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
}
PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "by", "without", "on",
                   "ignoring", "group_left", "group_right"}  # fmt: skip


def exported(registry: CollectorRegistry) -> set[str]:
    """Every series name a registry serves on /metrics (counters gain _total, histograms
    _bucket/_count/_sum), whether or not a labelled child has been created yet."""
    names = set()
    for family in registry.collect():
        names |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    return names


def gateway_names() -> set[str]:
    return exported(GatewayMetrics().registry)


def engine_names() -> set[str]:
    # vLLM's own names only: the simulator's extra pdserve_sim_* series do not exist in vLLM.
    return {n for n in exported(EngineMetrics("m").registry) if n.startswith("vllm:")}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana variables allowed)."""
    text = re.sub(r"label_values\((.*),\s*\w+\)", r"\1", expr)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)  # string literals (label values)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    text = re.sub(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text
    )  # label lists
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # Grafana variables ($__rate_interval, ...)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group()
        is_call = text[match.end() :].lstrip().startswith("(")
        is_number = match.start() > 0 and (
            text[match.start() - 1].isdigit() or text[match.start() - 1] == "."
        )
        if not is_call and not is_number and word.lower() not in PROMQL_KEYWORDS:
            names.add(word)
    return names


def dashboard() -> dict[str, Any]:
    result: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return result


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def expressions() -> list[str]:
    exprs = [t["expr"] for p in panels() for t in p["targets"]]
    variables = dashboard()["templating"]["list"]
    return exprs + [v["query"]["query"] for v in variables if v["type"] == "query"]


def test_the_extractor_finds_every_metric_and_nothing_else() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, stage) (rate(pdserve_gateway_nope_bucket{a="b",'
        ' le=~"$x|$x.0"}[$__rate_interval]))) / on(pod) group_left max(vllm:num_x) > bool 1e3'
        ' or label_values(kube_pod_info{namespace="$namespace"}, pod)'
    )
    assert metric_names(expr) == {"pdserve_gateway_nope_bucket", "vllm:num_x", "kube_pod_info"}


def test_registries_name_what_metrics_endpoints_serve() -> None:
    metrics = GatewayMetrics()
    metrics.requests.labels("render_pd", "ok").inc()
    metrics.ttft.labels("render_pd").observe(0.1)
    served = {
        line.split("{")[0].split(" ")[0]
        for line in generate_latest(metrics.registry).decode().splitlines()
        if line and not line.startswith("#")
    }
    assert "pdserve_gateway_requests_total" in served
    assert "pdserve_gateway_ttft_seconds_bucket" in served
    assert served <= exported(metrics.registry)


@pytest.mark.parametrize("expr", expressions())
def test_every_query_uses_only_metrics_that_exist(expr: str) -> None:
    names = metric_names(expr)
    assert names, f"no metric found in {expr}"
    unknown = names - gateway_names() - engine_names() - KUBE_STATE_METRICS - CADVISOR
    assert not unknown, f"{expr} queries {sorted(unknown)}, which nothing exports"


def test_every_panel_filters_by_namespace_and_model_through_the_variables() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "model", "ttft_slo"} <= set(variables)
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert '"$namespace"' in target["expr"], (panel["title"], target["expr"])
            assert "$model" in target["expr"], (panel["title"], target["expr"])


def test_model_and_pool_labels_come_from_the_chart_pod_monitor() -> None:
    monitor = (CHART / "templates" / "podmonitor.yaml").read_text()
    assert "targetLabel: model" in monitor
    assert "targetLabel: pool" in monitor
    assert any('model="$model"' in e for e in expressions())
    assert any("pool=" in e for e in expressions())


def test_panels_cover_the_issue_list() -> None:
    titles = " | ".join(p["title"] for p in panels())
    for wanted in ("TTFT p50 / p99", "ITL p50 / p99", "Goodput", "Latency per stage",
                   "Queue depth per class", "KV handoff time", "Render CPU", "Replicas",
                   "Fallbacks"):  # fmt: skip
        assert wanted in titles
    ids = [p["id"] for p in dashboard()["panels"]]
    assert len(ids) == len(set(ids))


def test_goodput_uses_a_bucket_bound_of_the_ttft_histogram() -> None:
    """le="1.0" (prometheus_client) is stored as "1" by Prometheus 3: the query matches both."""
    [slo] = [v for v in dashboard()["templating"]["list"] if v["name"] == "ttft_slo"]
    buckets = set(LATENCY)
    choices = [o["value"] for o in slo["options"]]
    assert choices
    assert {float(c) for c in choices} <= buckets
    assert slo["current"]["value"] in choices
    goodput = [e for e in expressions() if "$ttft_slo" in e]
    assert goodput
    assert all('le=~"$ttft_slo|$ttft_slo.0"' in e for e in goodput)
