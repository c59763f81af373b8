"""The chart's PrometheusRule (monitoring.prometheusRule): rendered by the real helm, checked by
promtool (Prometheus v3's, built by devtools/bin-src/build.sh) and every alert evaluated by
promtool's rule unit tests against recorded series (prometheus/rules_test.yaml): each fires when
it should and stays quiet otherwise. The recorded series must be what our exporters serve: their
names and labels are checked against the /metrics text of the operator's and the gateway's own
registries, and so are the rules' metrics, so a renamed metric or label fails here."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from devtools.clitools import ensure_cli_tools
from devtools.localplane import build_binaries
from pdserve.api import Condition, ConditionType, DisaggregatedModelStatus
from pdserve.controller.runner import Reconciler
from pdserve.controller.settings import OperatorSettings
from pdserve.gateway.metrics import LATENCY, GatewayMetrics
from pdserve.kube.client import Kube
from tests.unit.test_dashboard import metric_names

pytestmark = pytest.mark.cluster

HERE = Path(__file__).resolve().parent
CHART = HERE.parents[1] / "charts" / "pdserve"
RULES_TEST = HERE / "prometheus" / "rules_test.yaml"
NAMESPACE = "pdserve-system"
ENABLED = ("monitoring.prometheusRule.enabled=true", "monitoring.podMonitor.enabled=true")
# What Prometheus adds to every series scraped through the chart's PodMonitors: prometheus-operator
# gives each target job, namespace, pod, container, endpoint and instance; the pools' PodMonitor
# relabels model and pool from the pod's labels. The operator's own namespace/model labels win
# over the target's (honorLabels).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "endpoint", "model", "pool"}
SERIES = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>.*)\}$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def helm(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **{f"HELM_{d}_HOME": str(tmp / d.lower()) for d in ("CACHE", "CONFIG",
                                                                          "DATA")}}  # fmt: skip
    return subprocess.run([str(ensure_cli_tools().helm), *args], capture_output=True, text=True,
                          env=env, timeout=120, check=False)  # fmt: skip


def render(tmp: Path, *sets: str) -> list[dict[str, Any]]:
    args = [arg for value in sets for arg in ("--set", value)]
    proc = helm(tmp, "template", "pdserve", str(CHART), "-n", NAMESPACE, *args)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def rule_groups(tmp: Path, *sets: str) -> list[dict[str, Any]]:
    [rule] = [d for d in render(tmp, *ENABLED, *sets) if d["kind"] == "PrometheusRule"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def alerts(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for g in groups for r in g["rules"] if "alert" in r]


@pytest.fixture(scope="module")
def promtool() -> Path:
    path = build_binaries().path("promtool")
    assert path.exists(), f"{path} is missing: devtools/bin-src/build.sh builds it"
    return path


def promtool_test(promtool: Path, tmp: Path, groups: list[dict[str, Any]]) -> str:
    """`promtool check rules`, which must pass, then `promtool test rules` with rules_test.yaml;
    its output, raising when it fails. Annotations are left out of what the unit tests compare
    (promtool compares them whole); `check rules` parses their templates, and
    test_annotations_name_only_labels_the_alert_keeps checks what they reference."""
    tmp.mkdir(parents=True, exist_ok=True)
    rules = tmp / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    check = subprocess.run([str(promtool), "check", "rules", str(rules)], capture_output=True,
                           text=True, timeout=60, check=False)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    bare = [{**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
            for g in groups]  # fmt: skip
    rules.write_text(yaml.safe_dump({"groups": bare}, sort_keys=False))
    (tmp / "rules_test.yaml").write_text(RULES_TEST.read_text())
    run = subprocess.run([str(promtool), "test", "rules", "rules_test.yaml"], cwd=tmp,
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    if run.returncode != 0:
        raise AssertionError(run.stdout + run.stderr)
    return run.stdout


def test_every_alert_fires_when_it_should_and_stays_quiet_otherwise(
    tmp_path: Path, promtool: Path
) -> None:
    out = promtool_test(promtool, tmp_path / "rules", rule_groups(tmp_path))
    assert "SUCCESS" in out


def test_a_wrong_threshold_fails_the_rule_tests(tmp_path: Path, promtool: Path) -> None:
    """The rule tests can fail: with a 5xx ratio of 50% the failing model's 15% never fires, and
    with a TTFT bound of 5 s the slow model's first tokens meet it."""
    groups = rule_groups(tmp_path, "monitoring.prometheusRule.gateway5xx.ratio=0.5")
    with pytest.raises(AssertionError, match="PdserveGateway5xxRatioHigh"):
        promtool_test(promtool, tmp_path / "rules", groups)
    groups = rule_groups(tmp_path, "monitoring.prometheusRule.slo.ttft.seconds=5")
    with pytest.raises(AssertionError, match="PdserveTTFTSLOBurn"):
        promtool_test(promtool, tmp_path / "rules", groups)


def test_each_alert_has_a_firing_and_a_quiet_case() -> None:
    cases: dict[str, set[bool]] = {}
    for group in yaml.safe_load(RULES_TEST.read_text())["tests"]:
        for case in group["alert_rule_test"]:
            cases.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
    assert cases, "no alert_rule_test"
    for name, seen in cases.items():
        assert seen == {True, False}, f"{name}: needs a case that fires and one that does not"


def test_every_rendered_alert_is_tested(tmp_path: Path) -> None:
    tested = {
        case["alertname"]
        for group in yaml.safe_load(RULES_TEST.read_text())["tests"]
        for case in group["alert_rule_test"]
    }
    rendered = {a["alert"] for a in alerts(rule_groups(tmp_path))}
    assert rendered == tested
    assert rendered == {
        "PdserveModelNotReady", "PdserveParityDrift", "PdserveKVTransportUnhealthy",
        "PdserveKVTransportNotVerified", "PdserveGateway5xxRatioHigh", "PdserveTTFTSLOBurn",
        "PdserveITLSLOBurn", "PdserveAutoscalerAtMax", "PdserveOperatorReconcileErrors",
    }  # fmt: skip


# ---- the series: what our exporters serve ----------------------------------------------------
KEY = ("llm", "qwen")


async def operator_metrics_text() -> str:
    """The operator's /metrics (--metrics-port) after what a pass and a Builtin decision tell."""
    settings = OperatorSettings(engine_metrics_seconds=0, autoscale_seconds=15)
    reconciler = Reconciler(cast(Kube, object()), settings)
    assert reconciler.autoscaler is not None
    try:
        status = DisaggregatedModelStatus(conditions=[
            Condition(type=kind.value, status="False", reason="Any", last_transition_time="t")
            for kind in ConditionType
        ])  # fmt: skip
        reconciler.metrics.observe(KEY, status, drifts=1)
        for result in ("success", "error", "crash"):
            reconciler.metrics.passes.labels(*KEY, result).inc()
        scaling = reconciler.autoscaler.metrics
        scaling.show(*KEY, "decode", 4, 4)
        scaling.recommended.labels(*KEY, "decode").set(6)
    finally:
        await reconciler.autoscaler.close()
    return generate_latest(reconciler.registry).decode()


def gateway_metrics_text() -> str:
    metrics = GatewayMetrics()
    metrics.requests.labels("render_pd", "ok").inc()
    metrics.ttft.labels("render_pd").observe(0.1)
    metrics.itl.labels("render_pd").observe(0.01)
    return generate_latest(metrics.registry).decode()


def served() -> dict[str, list[dict[str, str]]]:
    """Every sample's name -> the label sets it is served with."""
    out: dict[str, list[dict[str, str]]] = {}
    for text in (asyncio.run(operator_metrics_text()), gateway_metrics_text()):
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out.setdefault(sample.name, []).append(dict(sample.labels))
    return out


def recorded() -> Iterator[tuple[str, dict[str, str]]]:
    for group in yaml.safe_load(RULES_TEST.read_text())["tests"]:
        for series in group["input_series"]:
            match = SERIES.match(series["series"])
            assert match, series["series"]
            yield match["name"], dict(LABEL.findall(match["labels"]))


def test_recorded_series_are_what_our_exporters_serve() -> None:
    exported = served()
    seen = set()
    for name, labels in recorded():
        assert name in exported, f"{name}: no registry serves it"
        own = {key for each in exported[name] for key in each}
        # Every label the exporter puts on it, and besides those only what Prometheus adds.
        assert own <= set(labels), (name, sorted(own - set(labels)))
        assert set(labels) <= own | TARGET_LABELS, (name, sorted(set(labels) - own - TARGET_LABELS))
        if "le" in labels:  # a bound the histogram has, written as prometheus_client writes it
            assert labels["le"] in {each["le"] for each in exported[name]}, (name, labels["le"])
        if name == "pdserve_operator_model_condition":
            assert labels["condition"] in {kind.value for kind in ConditionType}
            assert labels["status"] in {"True", "False", "Unknown"}
        seen.add(name)
    assert seen == {
        "pdserve_operator_model_condition", "pdserve_operator_parity_drift_total",
        "pdserve_operator_autoscale_replicas", "pdserve_operator_autoscale_max_replicas",
        "pdserve_operator_autoscale_recommendation", "pdserve_operator_reconcile_total",
        "pdserve_gateway_requests_total", "pdserve_gateway_ttft_seconds_bucket",
        "pdserve_gateway_ttft_seconds_count", "pdserve_gateway_itl_seconds_bucket",
        "pdserve_gateway_itl_seconds_count",
    }  # fmt: skip


def by_labels(expr: str) -> set[str]:
    return {
        label.strip()
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr)
        for label in group.split(",")
    }


def test_rules_read_only_metrics_and_labels_that_exist(tmp_path: Path) -> None:
    exported = served()
    for rule in alerts(rule_groups(tmp_path)):
        expr = rule["expr"]
        names = metric_names(expr)
        assert names, expr
        assert names <= set(exported), (rule["alert"], sorted(names - set(exported)))
        own = {key for name in names for each in exported[name] for key in each}
        matched = set(re.findall(r"(\w+)\s*(?:=~|!=|!~|=)\s*\"", expr))
        assert matched | by_labels(expr) <= own | TARGET_LABELS, (rule["alert"], expr)


def test_annotations_name_only_labels_the_alert_keeps(tmp_path: Path) -> None:
    """A `$labels.x` the expression aggregated away would print nothing; every alert tells what
    to look at and links the runbook."""
    for rule in alerts(rule_groups(tmp_path)):
        kept = by_labels(rule["expr"]) | set(rule["labels"])
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, rule["alert"]
        assert "kubectl" in annotations["description"], rule["alert"]
        assert annotations["runbook_url"].endswith("docs/operations.md#alerts")
        for text in annotations.values():
            for label in re.findall(r"\$labels\.(\w+)", text):
                assert label in kept, (rule["alert"], label)


# ---- the values ------------------------------------------------------------------------------


def test_rule_is_off_by_default_and_its_values_reach_the_rules(tmp_path: Path) -> None:
    assert not [d for d in render(tmp_path) if d["kind"] == "PrometheusRule"]
    docs = render(tmp_path, *ENABLED, "monitoring.prometheusRule.labels.release=kps",
                  "monitoring.prometheusRule.alertLabels.team=ml",
                  "monitoring.prometheusRule.modelNotReady.for=45m",
                  "monitoring.prometheusRule.disabled={PdserveITLSLOBurn}")  # fmt: skip
    [rule] = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["metadata"]["namespace"] == NAMESPACE
    found = alerts(rule["spec"]["groups"])
    assert "PdserveITLSLOBurn" not in {a["alert"] for a in found}
    assert all(a["labels"]["team"] == "ml" for a in found)
    [ready] = [a for a in found if a["alert"] == "PdserveModelNotReady"]
    assert ready["for"] == "45m"
    # The SLO bound as both spellings of the bucket's le (prometheus_client "2.0", or "2").
    [fast, slow] = [a for a in found if a["alert"] == "PdserveTTFTSLOBurn"]
    assert 'le=~"2|2.0"' in fast["expr"]
    assert (fast["labels"]["long_window"], slow["labels"]["long_window"]) == ("1h", "6h")


def test_the_operator_and_gateway_series_are_scraped_with_the_labels_the_rules_read(
    tmp_path: Path,
) -> None:
    pools, operator = [d for d in render(tmp_path, *ENABLED) if d["kind"] == "PodMonitor"]
    relabelled = {r["targetLabel"] for r in pools["spec"]["podMetricsEndpoints"][0]["relabelings"]}
    assert {"model", "pool"} <= relabelled
    # The operator's namespace/model labels are the model's: not renamed exported_namespace.
    assert operator["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True
    proc = helm(tmp_path, "template", "pdserve", str(CHART), "--set", ENABLED[0],
                "--set", "operator.metricsPort=0")  # fmt: skip
    assert proc.returncode != 0
    assert "monitoring.prometheusRule needs operator.metricsPort" in proc.stderr


def test_chart_with_the_rule_lints_strictly(tmp_path: Path) -> None:
    args = [arg for value in ENABLED for arg in ("--set", value)]
    proc = helm(tmp_path, "lint", "--strict", str(CHART), *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_slo_bounds_are_the_gateway_histograms_buckets() -> None:
    """As numbers, and the fractions as the strings `helm --set` passes them as."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    bounds = schema["definitions"]["slo"]["properties"]["seconds"]["enum"]
    assert [b for b in bounds if not isinstance(b, str)] == list(LATENCY)
    spelled = [b for b in bounds if isinstance(b, str)]
    assert spelled == [f"{b:g}" for b in LATENCY if b < 1]


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("monitoring.prometheusRule.enabled=maybe", "enabled"),
        ("monitoring.prometheusRule.slo.ttft.seconds=3", "seconds"),  # not a bucket bound
        ("monitoring.prometheusRule.slo.itl.objective=1", "objective"),
        ("monitoring.prometheusRule.gateway5xx.ratio=5", "ratio"),
        ("monitoring.prometheusRule.reconcileErrors.ratio=1.5", "ratio"),
        ("monitoring.prometheusRule.slo.itl.seconds=0.3", "seconds"),
        ("monitoring.prometheusRule.modelNotReady.for=30 minutes", "for"),
        ("monitoring.prometheusRule.disabled={PdserveNope}", "disabled"),
        ("monitoring.prometheusRule.parityDrift.threshold=0", "threshold"),
        ("monitoring.prometheusRule.modelNotReady.after=5m", "after"),
    ],
)
def test_schema_refuses_bad_rule_values_naming_them(tmp_path: Path, value: str, field: str) -> None:
    proc = helm(tmp_path, "template", "pdserve", str(CHART), "--set", value)
    assert proc.returncode != 0
    assert field in proc.stderr
