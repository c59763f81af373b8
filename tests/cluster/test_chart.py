"""The Helm chart: lint, render for every documented option, bad values refused by the schema,
and the default rendering installed for real into the local control plane (operator available on
a kwok node, its RBAC enough for its job and no more)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.clitools import Kubectl, ensure_cli_tools
from tests.cluster.localplane import wait_until

pytestmark = pytest.mark.cluster

CHART = Path(__file__).resolve().parents[2] / "charts" / "pdserve"
RELEASE_NAMESPACE = "pdserve-system"


def helm(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(tmp / "cache"),
        "HELM_CONFIG_HOME": str(tmp / "config"),
        "HELM_DATA_HOME": str(tmp / "data"),
    }
    return subprocess.run(
        [str(ensure_cli_tools().helm), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def render(tmp: Path, *sets: str) -> list[dict[str, Any]]:
    args = ["template", "pdserve", str(CHART), "-n", RELEASE_NAMESPACE]
    for value in sets:
        args += ["--set", value]
    proc = helm(*args, tmp=tmp)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_chart_lints_strictly(tmp_path: Path) -> None:
    proc = helm("lint", "--strict", str(CHART), tmp=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_default_rendering_is_secure_and_cluster_wide(tmp_path: Path) -> None:
    docs = render(tmp_path)
    [deployment] = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["image"] == "ghcr.io/pdserve/pdserve:0.1.0"
    assert "--webhook-port=9443" in container["args"]
    [cluster_role] = by_kind(docs, "ClusterRole")
    verbs = {v for rule in cluster_role["rules"] for v in rule["verbs"]}
    resources = {r for rule in cluster_role["rules"] for r in rule["resources"]}
    assert "*" not in verbs | resources
    assert "statefulsets" in resources
    assert not by_kind(docs, "Role")
    [webhook] = by_kind(docs, "ValidatingWebhookConfiguration")
    [hook] = webhook["webhooks"]
    assert hook["clientConfig"]["service"]["path"] == "/spec"
    assert hook["clientConfig"]["caBundle"]


def test_watching_namespaces_uses_roles_there_only(tmp_path: Path) -> None:
    docs = render(tmp_path, "operator.watchNamespaces={team-a,team-b}", "webhook.enabled=false")
    roles = by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    [cluster_role] = by_kind(docs, "ClusterRole")
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "customresourcedefinitions",
        "namespaces",
    }
    assert not by_kind(docs, "ValidatingWebhookConfiguration")
    args = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args
    assert not [a for a in args if a.startswith("--webhook")]


def test_cert_manager_option_issues_a_certificate(tmp_path: Path) -> None:
    docs = render(tmp_path, "webhook.certManager.enabled=true")
    kinds = sorted(d["kind"] for d in docs if d["apiVersion"].startswith("cert-manager"))
    assert kinds == ["Certificate", "Issuer"]
    [webhook] = by_kind(docs, "ValidatingWebhookConfiguration")
    assert "cert-manager.io/inject-ca-from" in webhook["metadata"]["annotations"]
    assert not by_kind(docs, "Secret")


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("operator.logLevel=LOUD", "logLevel"),
        ("webhook.failurePolicy=Maybe", "failurePolicy"),
        ("operator.resyncSeconds=0", "resyncSeconds"),
        ("imagee.tag=x", "imagee"),
    ],
)
def test_schema_refuses_bad_values_naming_them(tmp_path: Path, value: str, field: str) -> None:
    proc = helm("template", "pdserve", str(CHART), "--set", value, tmp=tmp_path)
    assert proc.returncode != 0
    assert field in proc.stderr


def test_chart_installs_into_the_real_control_plane(tmp_path: Path, kubectl: Kubectl) -> None:
    kubectl("apply", "--server-side", "-f", str(CHART / "crds"), check=True)
    namespace = yaml.safe_dump(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": RELEASE_NAMESPACE}}
    )
    kubectl("apply", "--server-side", "-f", "-", stdin=namespace, check=True)
    rendered = yaml.safe_dump_all(render(tmp_path, "webhook.failurePolicy=Ignore"))
    applied = kubectl(
        "apply",
        "--server-side",
        "--field-manager=helm",
        "--validate=strict",
        "-f",
        "-",
        stdin=rendered,
    )
    assert applied.returncode == 0, applied.stderr
    try:
        waited = kubectl(
            "-n", RELEASE_NAMESPACE, "rollout", "status", "deploy/pdserve", "--timeout=90s"
        )
        assert waited.returncode == 0, waited.stderr
        account = f"system:serviceaccount:{RELEASE_NAMESPACE}:pdserve"
        for verb, resource, expected in (
            ("create", "statefulsets.apps", "yes"),
            ("patch", "disaggregatedmodels.pdserve.io --subresource=status", "yes"),
            ("patch", "disaggregatedmodels.pdserve.io", "no"),  # the spec belongs to the user
            ("delete", "nodes", "no"),
            ("get", "secrets", "no"),
        ):
            answer = kubectl(
                "auth", "can-i", verb, *resource.split(), f"--as={account}", "-n", "default"
            )
            assert answer.stdout.strip() == expected, (verb, resource, answer.stdout)
    finally:
        kubectl(
            "delete", "validatingwebhookconfiguration", "pdserve-validate", "--ignore-not-found"
        )

    def gone() -> bool:
        listed = kubectl("get", "validatingwebhookconfiguration", "-o", "name")
        return "pdserve-validate" not in listed.stdout

    wait_until("the chart's webhook configuration to be deleted", gone, timeout=30)


def test_pod_monitor_scrapes_every_managed_pool(tmp_path: Path) -> None:
    assert not [d for d in render(tmp_path) if d["kind"] == "PodMonitor"]
    docs = render(tmp_path, "monitoring.podMonitor.enabled=true", "operator.watchNamespaces={llm}")
    [monitor] = by_kind(docs, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "pdserve"}
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["llm"]}
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
