"""The Helm chart: lint, render for every documented option, bad values refused by the schema,
the default rendering installed for real into the local control plane (operator available on
a kwok node, its RBAC enough for its job and no more), and the CRD's life with Helm: installed and
upgraded with the release, kept by `helm uninstall`, and a release of the chart that carried it in
crds/ upgraded by the documented step."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from devtools.clitools import Kubectl, ensure_cli_tools
from devtools.images import EARLIER_COMMIT
from devtools.localplane import ControlPlane, build_binaries, wait_until
from devtools.lws import install_lws_crd
from devtools.resources import KEDA_CRD
from pdserve.api.crd import CRD_FILE, build_crd, render_chart_crd
from pdserve.builders.scaling import (
    GATEWAY_BUSY_METRIC,
    GATEWAY_DURATION_SERIES,
    PARSER_BUSY_METRIC,
    RENDER_HANDLERS,
    SERVER_DURATION_SERIES,
)
from pdserve.contract.names import LEADER_LEASE_NAME, PEER_MASTER_SECRET_NAME
from pdserve.contract.resource import PLURAL, VERSION
from pdserve.controller.children import MANAGED_KINDS
from pdserve.controller.settings import WebhookSettings
from pdserve.controller.webhook_cert import SECRET, WEBHOOK_CONFIGURATION, serve_own_certificate
from pdserve.kube.client import Kube
from pdserve.kube.credentials import load_credentials

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pdserve"
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


def render(
    tmp: Path, *sets: str, json_sets: tuple[str, ...] = (), chart: Path = CHART
) -> list[dict[str, Any]]:
    args = ["template", "pdserve", str(chart), "-n", RELEASE_NAMESPACE]
    for value in sets:
        args += ["--set", value]
    for value in json_sets:
        args += ["--set-json", value]
    proc = helm(*args, tmp=tmp)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc


OWN_ROLES = ("-peer-master", "-leader-election")


def model_roles(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Roles that let the operator manage models (the peer-master and leader-election Roles
    aside: they are in the release namespace in every mode)."""
    return [r for r in by_kind(docs, "Role") if not r["metadata"]["name"].endswith(OWN_ROLES)]


# Every optional object on: NetworkPolicies (operator flags, RBAC, the operator pod's policy),
# the Grafana dashboard ConfigMap and the Prometheus Adapter rules ConfigMap.
OPTIONS_ON = (
    "networkPolicy.enabled=true",
    "networkPolicy.metricsNamespaces={monitoring}",
    "grafana.dashboard.enabled=true",
    "grafana.dashboard.labels.team=ml",
    "prometheusAdapter.rules.enabled=true",
    "operator.podLabels.team=ml",
    "serviceAccount.annotations.iam\\.example/role=pdserve",
    "global.imageRegistry=registry.example",  # an umbrella chart's; read by none here
)
GATEWAY_FROM = (
    '[{"namespaceSelector":{"matchLabels":{"team":"apps"}}},{"ipBlock":{"cidr":"10.0.0.0/8"}}]'
)


@pytest.mark.parametrize("sets", [(), OPTIONS_ON], ids=["defaults", "options-on"])
def test_chart_lints_strictly(tmp_path: Path, sets: tuple[str, ...]) -> None:
    args = [arg for value in sets for arg in ("--set", value)]
    proc = helm("lint", "--strict", str(CHART), *args, tmp=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_default_rendering_is_secure_and_cluster_wide(tmp_path: Path) -> None:
    docs = render(tmp_path)
    [deployment] = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    # Two replicas behind leader election: they may overlap, so an upgrade rolls them.
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["image"] == "ghcr.io/pdserve/pdserve:0.1.0"
    # The gateways of models that name no image run the operator's own, whatever it is set to.
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PDSERVE_GATEWAY_IMAGE"] == "ghcr.io/pdserve/pdserve:0.1.0"
    moved = render(tmp_path, "image.repository=registry.example/pdserve", "image.tag=0.2.0")
    [upgraded] = by_kind(moved, "Deployment")
    [operator] = upgraded["spec"]["template"]["spec"]["containers"]
    assert (
        {e["name"]: e.get("value") for e in operator["env"]}["PDSERVE_GATEWAY_IMAGE"]
        == (operator["image"])
        == "registry.example/pdserve:0.2.0"
    )
    assert "--webhook-port=9443" in container["args"]
    [cluster_role] = by_kind(docs, "ClusterRole")
    verbs = {v for rule in cluster_role["rules"] for v in rule["verbs"]}
    resources = {r for rule in cluster_role["rules"] for r in rule["resources"]}
    assert "*" not in verbs | resources
    assert "statefulsets" in resources
    assert not model_roles(docs)
    [webhook] = by_kind(docs, "ValidatingWebhookConfiguration")
    [hook] = webhook["webhooks"]
    assert hook["clientConfig"]["service"]["path"] == "/spec"
    # Nothing random in a render: no CA, no certificate, no Secret. The operator makes its
    # certificate at start-up (Secret pdserve-webhook-tls) and puts the CA into caBundle, a
    # field the chart leaves alone; two renders, as helm template / Argo CD / Flux make them,
    # are the same bytes.
    assert "caBundle" not in hook["clientConfig"]
    assert not by_kind(docs, "Secret")
    assert {"--webhook-cert-secret=pdserve-webhook-tls",
            "--webhook-service-name=pdserve-webhook.pdserve-system.svc",
            "--webhook-configuration=pdserve-validate"} <= set(container["args"])  # fmt: skip
    assert not [a for a in container["args"] if a.startswith(("--webhook-cert=", "--webhook-key="))]
    again = helm("template", "pdserve", str(CHART), "-n", RELEASE_NAMESPACE, tmp=tmp_path)
    first = helm("template", "pdserve", str(CHART), "-n", RELEASE_NAMESPACE, tmp=tmp_path)
    assert again.stdout == first.stdout


def test_default_operator_runs_two_replicas_behind_a_leader_lease(tmp_path: Path) -> None:
    docs = render(tmp_path)
    [deployment] = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert "--leader-election" in container["args"]
    assert "--leader-election-lease-seconds=15" in container["args"]
    env = {e["name"]: e.get("valueFrom") for e in container["env"]}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["PDSERVE_OPERATOR_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    # Ready on the webhook port, which every replica serves, leader or not; the webhook Service
    # selects every replica.
    assert container["readinessProbe"]["tcpSocket"] == {"port": "webhook"}
    labels = deployment["spec"]["selector"]["matchLabels"]
    service = named(docs, "Service", "pdserve-webhook")
    assert service["spec"]["selector"] == labels
    [term] = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": labels},
    }
    [budget] = by_kind(docs, "PodDisruptionBudget")
    assert budget["spec"] == {"minAvailable": 1, "selector": {"matchLabels": labels}}
    role = named(docs, "Role", "pdserve-leader-election")
    assert role["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": [LEADER_LEASE_NAME], "verbs": ["get", "update"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    ]  # fmt: skip
    binding = named(docs, "RoleBinding", "pdserve-leader-election")
    assert binding["roleRef"]["name"] == "pdserve-leader-election"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "pdserve", "namespace": RELEASE_NAMESPACE}
    ]
    # The user's own affinity replaces the default spreading.
    mine = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "pool", "operator": "In", "values": ["system"]}]}]}}}  # fmt: skip
    docs = render(tmp_path, json_sets=(f"operator.affinity={json.dumps(mine)}",))
    assert by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["affinity"] == mine


def test_single_replica_without_leader_election(tmp_path: Path) -> None:
    docs = render(tmp_path, "operator.replicas=1", "operator.leaderElection.enabled=false")
    [deployment] = by_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # never two at once
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert not [a for a in container["args"] if a.startswith("--leader-election")]
    assert "affinity" not in deployment["spec"]["template"]["spec"]
    assert not by_kind(docs, "PodDisruptionBudget")  # minAvailable 1 of 1 would block drains
    assert not [r for r in by_kind(docs, "Role") if "leader" in r["metadata"]["name"]]
    # Several replicas without a Lease would all reconcile: refused, naming the values.
    proc = helm("template", "pdserve", str(CHART), "--set", "operator.leaderElection.enabled=false",
                tmp=tmp_path)  # fmt: skip
    assert proc.returncode != 0
    assert "operator.leaderElection.enabled" in proc.stderr
    assert "operator.replicas" in proc.stderr


def test_watching_namespaces_uses_roles_there_only(tmp_path: Path) -> None:
    docs = render(tmp_path, "operator.watchNamespaces={team-a,team-b}", "webhook.enabled=false")
    roles = model_roles(docs)
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


def test_the_knobs_platform_teams_set_reach_the_operator_pod(tmp_path: Path) -> None:
    digest = "sha256:" + "0123456789abcdef" * 4
    spread = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
              "whenUnsatisfiable": "ScheduleAnyway",
              "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "pdserve"}}}  # fmt: skip
    spreads = f"operator.topologySpreadConstraints={json.dumps([spread])}"
    docs = render(tmp_path, "operator.priorityClassName=platform-critical",
                  "operator.podLabels.team=ml", "serviceAccount.annotations.a=b",
                  f"image.digest={digest}", "global.anything=1", json_sets=(spreads,))  # fmt: skip
    [deployment] = by_kind(docs, "Deployment")
    template = deployment["spec"]["template"]
    assert template["spec"]["priorityClassName"] == "platform-critical"
    assert template["metadata"]["labels"]["team"] == "ml"
    assert template["spec"]["topologySpreadConstraints"] == [spread]
    [container] = template["spec"]["containers"]
    # Pinned by digest, and the gateways of models that name no image get the same reference.
    assert container["image"] == f"ghcr.io/pdserve/pdserve@{digest}"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PDSERVE_GATEWAY_IMAGE"] == container["image"]
    [account] = by_kind(docs, "ServiceAccount")
    assert account["metadata"]["annotations"] == {"a": "b"}
    refused = helm("template", "pdserve", str(CHART), "--set", "image.digest=latest", tmp=tmp_path)
    assert refused.returncode != 0
    assert "/image/digest" in refused.stderr


def test_an_upgrade_reusing_the_values_of_an_older_release_renders(tmp_path: Path) -> None:
    """`helm upgrade --reuse-values` takes the old release's values without this chart's
    defaults: a value added since is missing (null), and the chart must render without it."""
    added_since = ("serviceAccount=null", "image.digest=null",
                   "operator.priorityClassName=null", "operator.podLabels=null",
                   "operator.topologySpreadConstraints=null", "crds=null")  # fmt: skip
    docs = render(tmp_path, *added_since)
    # No crds value (charts before 0.2): the CRD is installed and upgraded, as by default.
    assert by_kind(docs, "CustomResourceDefinition")
    [deployment] = by_kind(docs, "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "ghcr.io/pdserve/pdserve:0.1.0"
    )


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
        ("networkPolicy.enabled=maybe", "enabled"),
        ("networkPolicy.metricsNamespaces={Monitoring}", "metricsNamespaces"),
        ("networkPolicy.gatewayFrom[0].pods.x=y", "gatewayFrom"),
        ("networkPolicy.gatewayFrom[0].ipBlock.cidr=10.0.0.0", "cidr"),
        ("grafana.dashboard.enabled=yes", "enabled"),
        ("grafana.dashboard.namespace=Grafana", "namespace"),
        ("grafana.dashboard.folderAnnotation=grafana folder", "folderAnnotation"),
        ("grafana.dashbord.enabled=true", "dashbord"),
        ("operator.autoscaleSeconds=-1", "autoscaleSeconds"),
        ("operator.engineMetricsSeconds=-1", "engineMetricsSeconds"),
        ("operator.metricsPort=70000", "metricsPort"),
        ("operator.replicas=0", "replicas"),
        ("operator.leaderElection.enabled=maybe", "enabled"),
        ("operator.leaderElection.leaseSeconds=2", "leaseSeconds"),
        ("prometheusAdapter.rules.enabled=maybe", "enabled"),
        ("prometheusAdapter.rules.namespace=Monitoring", "namespace"),
        ("crds.install=maybe", "install"),
    ],
)
def test_schema_refuses_bad_values_naming_them(tmp_path: Path, value: str, field: str) -> None:
    proc = helm("template", "pdserve", str(CHART), "--set", value, tmp=tmp_path)
    assert proc.returncode != 0
    assert field in proc.stderr


def can_i(
    kubectl: Kubectl, account: str, verb: str, resource: str, namespace: str = "default"
) -> str:
    answer = kubectl("auth", "can-i", verb, *resource.split(), f"--as={account}", "-n", namespace)
    return answer.stdout.strip()


def test_chart_installs_into_the_real_control_plane(
    tmp_path: Path, kubectl: Kubectl, control_plane: ControlPlane
) -> None:
    # KEDA's ScaledObject kind (a minimal CRD): `auth can-i` answers only for known resources.
    kubectl("apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(KEDA_CRD), check=True)
    kubectl("wait", "--for=condition=Established", "crd/scaledobjects.keda.sh", "--timeout=30s",
            check=True)  # fmt: skip
    install_lws_crd(control_plane, build_binaries(lws=True))  # the LeaderWorkerSet kind too
    namespace = yaml.safe_dump(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": RELEASE_NAMESPACE}}
    )
    kubectl("apply", "--server-side", "-f", "-", stdin=namespace, check=True)
    # Installed with every option on: the dashboard ConfigMap and the NetworkPolicy go through
    # the real API server's validation too, and the CRD (the chart's template) with them.
    options = render(tmp_path, "webhook.failurePolicy=Ignore", *OPTIONS_ON,
                     json_sets=(f"networkPolicy.gatewayFrom={GATEWAY_FROM}",))  # fmt: skip
    assert {"NetworkPolicy", "ConfigMap", "CustomResourceDefinition"} <= {
        d["kind"] for d in options
    }
    applied = kubectl(
        "apply",
        "--server-side",
        "--field-manager=helm",
        "--validate=strict",
        "-f",
        "-",
        stdin=yaml.safe_dump_all(options),
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
            ("get", "secrets", "no"),  # never a user's Secret: see the peer master below
            ("watch", "events", "yes"),  # the gateways' replica-check Events, cached
            ("create", "networkpolicies.networking.k8s.io", "yes"),  # networkPolicy.enabled
        ):
            assert can_i(kubectl, account, verb, resource) == expected, (verb, resource)
        # Every kind the operator applies and prunes (from the code, so a new kind cannot be
        # forgotten here), and the kv-transport annotation it puts on engine pods.
        for kind in MANAGED_KINDS:
            group = kind.api_version.split("/")[0] if "/" in kind.api_version else ""
            resource = f"{kind.plural}.{group}" if group else kind.plural
            for verb in ("list", "watch", "create", "patch", "delete"):
                assert can_i(kubectl, account, verb, resource) == "yes", (verb, resource)
        # Secrets: the gateways' peer keys are applied and pruned unread; the one Secret the
        # operator reads is its peer master key, by name, in its own namespace.
        for namespace in ("default", RELEASE_NAMESPACE):
            for verb in ("get", "list", "watch"):
                answer = can_i(kubectl, account, verb, "secrets", namespace)
                assert answer == "no", (verb, namespace)
            assert can_i(kubectl, account, "get", "secrets/other", namespace) == "no", namespace
        for verb in ("create", "patch", "delete"):
            assert can_i(kubectl, account, verb, "secrets") == "yes", verb
        master = f"secrets/{PEER_MASTER_SECRET_NAME}"
        assert can_i(kubectl, account, "get", master, RELEASE_NAMESPACE) == "yes"
        assert can_i(kubectl, account, "get", master) == "no"  # not a master in a user's namespace
        assert can_i(kubectl, account, "create", "secrets", RELEASE_NAMESPACE) == "yes"
        # The webhook's certificate: its one Secret, read and remade, in the release namespace;
        # its CA put into the chart's own webhook configuration only.
        tls = "secrets/pdserve-webhook-tls"
        for verb in ("get", "update"):
            assert can_i(kubectl, account, verb, tls, RELEASE_NAMESPACE) == "yes", verb
            assert can_i(kubectl, account, verb, tls) == "no", verb
        hooks = "validatingwebhookconfigurations.admissionregistration.k8s.io"
        for verb in ("get", "patch"):
            assert can_i(kubectl, account, verb, f"{hooks}/pdserve-validate") == "yes", verb
            assert can_i(kubectl, account, verb, f"{hooks}/other") == "no", verb
        assert can_i(kubectl, account, "patch", "pods") == "yes"
        # The leader Lease: get and update on its name alone, in the release namespace.
        lease = f"leases.coordination.k8s.io/{LEADER_LEASE_NAME}"
        for verb in ("get", "update"):
            assert can_i(kubectl, account, verb, lease, RELEASE_NAMESPACE) == "yes", verb
            other = "leases.coordination.k8s.io/other"
            assert can_i(kubectl, account, verb, other, RELEASE_NAMESPACE) == "no", verb
            assert can_i(kubectl, account, verb, lease) == "no", verb  # not in a user's namespace
        assert can_i(kubectl, account, "create", "leases.coordination.k8s.io",
                     RELEASE_NAMESPACE) == "yes"  # fmt: skip
        assert can_i(kubectl, account, "delete", lease, RELEASE_NAMESPACE) == "no"
        # Switched off (as `helm upgrade` would): nothing is created, but what was made can
        # still be pruned.
        switched_off = render(tmp_path, "webhook.failurePolicy=Ignore")
        [cluster_role] = by_kind(switched_off, "ClusterRole")
        off = kubectl("apply", "--server-side", "--field-manager=helm", "-f", "-",
                      stdin=yaml.safe_dump(cluster_role))  # fmt: skip
        assert off.returncode == 0, off.stderr
        want = {"create": "no", "patch": "no", "list": "yes", "delete": "yes"}

        def switched() -> bool:
            resource = "networkpolicies.networking.k8s.io"
            return {verb: can_i(kubectl, account, verb, resource) for verb in want} == want

        wait_until("NetworkPolicy RBAC to be prune-only", switched, timeout=10)
        operator_puts_its_ca_into_the_charts_webhook_configuration(control_plane, tmp_path, kubectl)
    finally:
        kubectl(
            "delete", "validatingwebhookconfiguration", "pdserve-validate", "--ignore-not-found"
        )

    def gone() -> bool:
        listed = kubectl("get", "validatingwebhookconfiguration", "-o", "name")
        return "pdserve-validate" not in listed.stdout

    wait_until("the chart's webhook configuration to be deleted", gone, timeout=30)


def operator_puts_its_ca_into_the_charts_webhook_configuration(
    plane: ControlPlane, tmp_path: Path, kubectl: Kubectl
) -> None:
    """What the operator does at start-up with the chart's flags (--webhook-cert-secret ...),
    against the installed chart: its certificate made into the Secret, the CA put into the
    configuration's caBundle; a second start writes nothing, and the chart applied again (a
    `helm upgrade`, a GitOps sync: the chart has no caBundle) leaves the CA in place."""
    [deployment] = by_kind(render(tmp_path), "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    flag = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if "=" in a}
    hook = WebhookSettings(
        port=9443, cert_file=str(tmp_path / "webhook" / "tls.crt"),
        key_file=str(tmp_path / "webhook" / "tls.key"),
        cert_secret=flag["--webhook-cert-secret"],
        service_names=(flag["--webhook-service-name"],),
        configuration=flag["--webhook-configuration"],
    )  # fmt: skip

    async def start() -> tuple[str, str]:
        kube = Kube(load_credentials(str(plane.kubeconfig())))
        try:
            await serve_own_certificate(kube, RELEASE_NAMESPACE, hook)
            secret = await kube.get(SECRET, RELEASE_NAMESPACE, "pdserve-webhook-tls")
            configuration = await kube.get(WEBHOOK_CONFIGURATION, None, "pdserve-validate")
        finally:
            await kube.close()
        assert secret is not None
        assert configuration is not None
        [webhook] = configuration["webhooks"]
        assert webhook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
        versions = (
            secret["metadata"]["resourceVersion"],
            configuration["metadata"]["resourceVersion"],
        )
        return versions

    try:
        first = asyncio.run(start())
        assert asyncio.run(start()) == first  # nothing written the second time
        chart = [d for d in render(tmp_path, "webhook.failurePolicy=Ignore")
                 if d["kind"] == "ValidatingWebhookConfiguration"]  # fmt: skip
        again = kubectl("apply", "--server-side", "--field-manager=helm", "-f", "-",
                        stdin=yaml.safe_dump_all(chart))  # fmt: skip
        assert again.returncode == 0, again.stderr
        assert asyncio.run(start()) == first
    finally:
        kubectl("delete", "secret", "pdserve-webhook-tls", "-n", RELEASE_NAMESPACE,
                "--ignore-not-found")  # fmt: skip


def test_pod_monitor_scrapes_every_managed_pool(tmp_path: Path) -> None:
    assert not [d for d in render(tmp_path) if d["kind"] == "PodMonitor"]
    docs = render(tmp_path, "monitoring.podMonitor.enabled=true", "operator.watchNamespaces={llm}")
    monitor, operator = by_kind(docs, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "pdserve"}
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["llm"]}
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    # The operator's own metrics (its autoscaling decisions), on the port its pod names.
    [endpoint] = operator["spec"]["podMetricsEndpoints"]
    [deployment] = by_kind(docs, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 8081} in container["ports"]
    assert endpoint["port"] == "metrics"
    assert (
        operator["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    )


def test_network_policy_option_switches_the_operator_and_protects_its_pod(tmp_path: Path) -> None:
    docs = render(tmp_path)
    args = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith("--network-polic")]
    assert not by_kind(docs, "NetworkPolicy")
    [rule] = [
        r for r in by_kind(docs, "ClusterRole")[0]["rules"] if "networkpolicies" in r["resources"]
    ]
    assert rule["verbs"] == ["list", "watch", "delete"]  # prune only: it creates none

    docs = render(tmp_path, *OPTIONS_ON, json_sets=(f"networkPolicy.gatewayFrom={GATEWAY_FROM}",))
    args = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--network-policies" in args
    assert "--network-policy-metrics-namespace=monitoring" in args
    [peers] = [a for a in args if a.startswith("--network-policy-gateway-from=")]
    assert json.loads(peers.split("=", 1)[1]) == json.loads(GATEWAY_FROM)
    [rule] = [
        r for r in by_kind(docs, "ClusterRole")[0]["rules"] if "networkpolicies" in r["resources"]
    ]
    assert rule["apiGroups"] == ["networking.k8s.io"]
    assert set(rule["verbs"]) == {"get", "list", "watch", "create", "patch", "delete"}
    [policy] = by_kind(docs, "NetworkPolicy")
    selector = by_kind(docs, "Deployment")[0]["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["podSelector"]["matchLabels"] == selector
    metrics_from = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name":
                                                            "monitoring"}}}]  # fmt: skip
    assert policy["spec"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": 9443}]},
        {"ports": [{"protocol": "TCP", "port": 8081}], "from": metrics_from},
    ]

    docs = render(tmp_path, "networkPolicy.enabled=true", "webhook.enabled=false",
                  "operator.watchNamespaces={llm}")  # fmt: skip
    [policy] = by_kind(docs, "NetworkPolicy")
    assert policy["spec"]["ingress"] == []  # no webhook: nothing may connect
    [role] = model_roles(docs)
    assert any("networkpolicies" in r["resources"] for r in role["rules"])


def test_grafana_dashboard_option_ships_the_chart_dashboard_to_the_sidecar(tmp_path: Path) -> None:
    assert not [
        d for d in by_kind(render(tmp_path), "ConfigMap") if "dashboard" in d["metadata"]["name"]
    ]
    docs = render(tmp_path, *OPTIONS_ON, "grafana.dashboard.namespace=grafana",
                  "grafana.dashboard.annotations.team=ml-platform")  # fmt: skip
    [config_map] = [d for d in by_kind(docs, "ConfigMap") if "dashboard" in d["metadata"]["name"]]
    meta = config_map["metadata"]
    assert (meta["name"], meta["namespace"]) == ("pdserve-dashboard", "grafana")
    assert meta["labels"]["grafana_dashboard"] == "1"
    assert meta["labels"]["team"] == "ml"
    assert meta["annotations"] == {"grafana_folder": "pdserve", "team": "ml-platform"}
    shipped = json.loads(config_map["data"]["pdserve.json"])
    assert shipped == json.loads((CHART / "dashboards" / "pdserve.json").read_text())

    docs = render(tmp_path, "grafana.dashboard.enabled=true", "grafana.dashboard.folder=",
                  "grafana.dashboard.labels.grafana_dashboard=null",
                  "grafana.dashboard.labels.my-sidecar=yes")  # fmt: skip
    [config_map] = by_kind(docs, "ConfigMap")
    assert "annotations" not in config_map["metadata"]
    assert "grafana_dashboard" not in config_map["metadata"]["labels"]
    assert config_map["metadata"]["labels"]["my-sidecar"] == "yes"
    assert config_map["metadata"]["namespace"] == RELEASE_NAMESPACE


def test_prometheus_adapter_rules_serve_the_metrics_the_render_hpa_names(tmp_path: Path) -> None:
    assert not [d for d in by_kind(render(tmp_path), "ConfigMap")]
    docs = render(tmp_path, "prometheusAdapter.rules.enabled=true",
                  "prometheusAdapter.rules.namespace=monitoring")  # fmt: skip
    [config_map] = by_kind(docs, "ConfigMap")
    meta = config_map["metadata"]
    assert (meta["name"], meta["namespace"]) == ("pdserve-prometheus-adapter-rules", "monitoring")
    rules = yaml.safe_load(config_map["data"]["config.yaml"])["rules"]
    # The names the builders put in the HPA's Pods metrics, from the code: they cannot drift.
    assert [r["name"]["as"] for r in rules] == [PARSER_BUSY_METRIC, GATEWAY_BUSY_METRIC]
    parser, gateway = rules
    assert parser["seriesQuery"].startswith(SERVER_DURATION_SERIES + "{")
    assert f'handler=~"{RENDER_HANDLERS}"' in parser["metricsQuery"]
    assert parser["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert gateway["seriesQuery"].startswith(GATEWAY_DURATION_SERIES + "{")
    # The gateway series is per gateway pod; its render_pod label names the render pod.
    assert gateway["resources"]["overrides"]["render_pod"] == {"resource": "pod"}
    for rule in rules:
        assert "rate(<<.Series>>{<<.LabelMatchers>>" in rule["metricsQuery"]
        assert "by (<<.GroupBy>>)" in rule["metricsQuery"]


def test_operator_runs_the_builtin_autoscaler_at_the_chosen_period(tmp_path: Path) -> None:
    args = by_kind(render(tmp_path), "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "--autoscale-seconds=15" in args["args"]
    assert "--metrics-port=8081" in args["args"]
    docs = render(tmp_path, "operator.autoscaleSeconds=0", "operator.metricsPort=0")
    container = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "--autoscale-seconds=0" in container["args"]
    assert not [a for a in container["args"] if a.startswith("--metrics-port")]
    assert [p["name"] for p in container["ports"]] == ["health", "webhook"]


# The CRD's life with Helm. The chart's CRD template, generated from the API models like the
# committed one, renders the CRD itself; crds.install=false renders none.


def spec_properties(crd: dict[str, Any]) -> dict[str, Any]:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    properties: dict[str, Any] = schema["properties"]["spec"]["properties"]
    return properties


def test_the_chart_installs_the_crd_keeps_it_on_uninstall_or_leaves_it_out(
    tmp_path: Path,
) -> None:
    [crd] = by_kind(render(tmp_path), "CustomResourceDefinition")
    expected = build_crd()
    assert {**crd, "metadata": expected["metadata"]} == expected
    assert crd["metadata"]["name"] == expected["metadata"]["name"]
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    # Argo CD's client-side apply keeps the object as JSON in an annotation, and the API server
    # takes at most 256 KiB of annotations per object (server-side apply keeps none).
    size = len(json.dumps(crd, separators=(",", ":")))
    assert size < 256 * 1024, size
    assert not by_kind(render(tmp_path, "crds.install=false"), "CustomResourceDefinition")
    # A `{{` in the CRD's text (a chat template in a description) renders as written.
    braces = copy.deepcopy(expected)
    braces["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"] = "{{ a }} {{- b"
    [rendered] = by_kind(render(tmp_path, chart=chart_with_crd(tmp_path, braces)),
                         "CustomResourceDefinition")  # fmt: skip
    assert rendered["spec"] == braces["spec"]


# Releases here install the CRD under a group of their own: the session's other tests use the
# real one (the dm_crd fixture), which a release here must neither take over nor delete (that
# would delete every model in the session). Everything else is the chart as it is.
ADDED_FIELD = "progressDeadlineSeconds"  # what an older CRD lacks
EXAMPLE = REPO / "examples" / "sim-qwen3.yaml"
# The last revision whose chart carried the CRD in crds/ (0.1's layout): the previous release.
PREVIOUS_LAYOUT = EARLIER_COMMIT
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


def crd_in_group(crd: dict[str, Any], group: str, *, without: str | None = None) -> dict[str, Any]:
    crd = copy.deepcopy(crd)
    crd["metadata"]["name"] = f"{PLURAL}.{group}"
    crd["spec"]["group"] = group
    if without is not None:
        del spec_properties(crd)[without]
    return crd


def chart_with_crd(tmp: Path, crd: dict[str, Any]) -> Path:
    """This chart, its CRD template generated from `crd` by the generator of its own."""
    chart = tmp / f"chart-{crd['spec']['group']}" / "pdserve"
    shutil.copytree(CHART, chart)
    (chart / "templates" / "crds.yaml").write_text(render_chart_crd(crd))
    return chart


def previous_chart(tmp: Path, group: str) -> Path:
    """The chart as it was while it carried its CRD in crds/ (Helm creates it at install, outside
    the release, and never touches it again) and none in templates/: PREVIOUS_LAYOUT's, or, in a
    clone without that revision (shallow), this chart laid out so. Its CRD lacks ADDED_FIELD."""
    target = tmp / "previous"
    target.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", PREVIOUS_LAYOUT, "charts/pdserve"],
        capture_output=True, check=False,
    ) if shutil.which("git") else None  # fmt: skip
    if archive is not None and archive.returncode == 0:
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
        chart = target / "charts" / "pdserve"
        crd = yaml.safe_load((chart / "crds" / CRD_FILE).read_text())
    else:
        chart = target / "pdserve"
        shutil.copytree(CHART, chart)
        (chart / "templates" / "crds.yaml").unlink()
        (chart / "crds").mkdir()
        crd = build_crd()
    older = crd_in_group(crd, group, without=ADDED_FIELD)
    (chart / "crds" / CRD_FILE).write_text(yaml.safe_dump(older))
    return chart


def apply_model(http: httpx.Client, group: str, namespace: str, **spec: Any) -> dict[str, Any]:
    """The simulator example as `sim` in `group`, created or replaced as controllers and many
    tools send it (no fieldValidation): a field the CRD lacks is dropped with a Warning header,
    not refused. (Server-side apply and kubectl's strict validation refuse it.)"""
    body = yaml.safe_load(EXAMPLE.read_text())
    body["apiVersion"] = f"{group}/{VERSION}"
    body["metadata"] = {"name": "sim", "namespace": namespace}
    body["spec"].update(spec)
    models = f"/apis/{group}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    existing = http.get(f"{models}/sim")
    if existing.status_code == 404:
        response = http.post(models, json=body)
    else:
        body["metadata"]["resourceVersion"] = existing.json()["metadata"]["resourceVersion"]
        response = http.put(f"{models}/sim", json=body)
    assert response.is_success, response.text
    result: dict[str, Any] = response.json()
    return result


def wait_until_a_model_keeps_the_added_field(
    http_api: httpx.Client, group: str, namespace: str
) -> None:
    """Until the API server stores spec.<ADDED_FIELD> instead of pruning it (the upgraded CRD
    is served a moment after helm returns)."""
    wait_until(
        f"a model keeping spec.{ADDED_FIELD}",
        lambda: apply_model(http_api, group, namespace, **{ADDED_FIELD: 900})["spec"].get(
            ADDED_FIELD) == 900,
        timeout=30,
    )  # fmt: skip


def served_crd(http: httpx.Client, name: str) -> dict[str, Any] | None:
    response = http.get(f"{CRDS}/{name}")
    if response.status_code == 404:
        return None
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def established(http: httpx.Client, name: str) -> bool:
    conditions = ((served_crd(http, name) or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


class Release:
    """`helm` against the plane for one release in `namespace`, named after it (its cluster-wide
    objects, ClusterRole and the like, then clash with no other test's); the webhook off (no
    operator runs here)."""

    def __init__(self, plane: ControlPlane, tmp: Path, namespace: str) -> None:
        self.plane, self.tmp, self.name, self.namespace = plane, tmp, namespace, namespace

    def helm(self, *args: str) -> subprocess.CompletedProcess[str]:
        return helm(*args, "-n", self.namespace, "--kubeconfig", str(self.plane.kubeconfig()),
                    tmp=self.tmp)  # fmt: skip

    def run(self, verb: str, chart: Path, *args: str) -> subprocess.CompletedProcess[str]:
        proc = self.helm(verb, self.name, str(chart), "--set", "webhook.enabled=false", *args)
        assert proc.returncode == 0, proc.stderr
        return proc

    def manifest(self) -> str:
        return self.helm("get", "manifest", self.name).stdout

    def uninstall(self, *, check: bool = True) -> None:
        proc = self.helm("uninstall", self.name, "--ignore-not-found")
        assert proc.returncode == 0 or not check, proc.stderr


def test_helm_upgrade_brings_the_new_crd_and_uninstall_keeps_it_and_the_models(
    tmp_path: Path, control_plane: ControlPlane, http_api: httpx.Client, namespace: str
) -> None:
    group = f"{namespace}.pdserve.test"
    current = crd_in_group(build_crd(), group)
    name = current["metadata"]["name"]
    older = chart_with_crd(tmp_path, crd_in_group(build_crd(), group, without=ADDED_FIELD))
    newer = chart_with_crd(tmp_path / "newer", current)
    release = Release(control_plane, tmp_path, namespace)
    try:
        release.run("install", older)
        wait_until("the older CRD Established", lambda: established(http_api, name), timeout=30)
        # What `helm upgrade` left in place before 0.2 (crds/ is never upgraded): a field the
        # CRD lacks is pruned from every model that sets it, silently.
        pruned = apply_model(http_api, group, namespace, **{ADDED_FIELD: 900})
        assert ADDED_FIELD not in pruned["spec"]

        release.run("upgrade", newer)
        assert ADDED_FIELD in spec_properties(served_crd(http_api, name) or {})
        # Helm keeps each revision (the chart, the CRD's template in it, and the rendered
        # manifest, gzipped) in a Secret, which holds at most 1 MiB: about 130 KB here.
        revisions = http_api.get(
            f"/api/v1/namespaces/{namespace}/secrets",
            params={"labelSelector": f"owner=helm,name={release.name}"},
        )
        sizes = [len(s["data"]["release"]) for s in revisions.json()["items"]]
        assert len(sizes) == 2
        assert max(sizes) < 512 * 1024, sizes
        wait_until_a_model_keeps_the_added_field(http_api, group, namespace)
        models = f"/apis/{group}/{VERSION}/namespaces/{namespace}/{PLURAL}"
        uid = http_api.get(f"{models}/sim").json()["metadata"]["uid"]

        # helm uninstall keeps the CRD (helm.sh/resource-policy: keep), so the models too.
        release.uninstall()
        crd = served_crd(http_api, name)
        assert crd is not None
        assert "deletionTimestamp" not in crd["metadata"]
        kept = http_api.get(f"{models}/sim")
        assert kept.is_success, kept.text
        assert (kept.json()["metadata"]["uid"], kept.json()["spec"][ADDED_FIELD]) == (uid, 900)

        # Installed again, the release takes back the CRD it left (its annotations name it).
        release.run("install", newer)
        assert "kind: CustomResourceDefinition" in release.manifest()
        # Handed over to GitOps: crds.install=false drops the CRD from the release, and the
        # upgrade leaves it in place.
        release.run("upgrade", newer, "--set", "crds.install=false")
        assert "CustomResourceDefinition" not in release.manifest()
        crd = served_crd(http_api, name)
        assert crd is not None
        assert "deletionTimestamp" not in crd["metadata"]
        assert http_api.get(f"{models}/sim").json()["metadata"]["uid"] == uid
    finally:
        release.uninstall(check=False)
        http_api.delete(f"{CRDS}/{name}")


@pytest.mark.parametrize("step", ["label-and-annotate", "take-ownership"])
def test_a_release_of_the_chart_with_crds_dir_upgrades_by_the_documented_step(
    step: str,
    tmp_path: Path,
    control_plane: ControlPlane,
    http_api: httpx.Client,
    kubectl: Kubectl,
    namespace: str,
) -> None:
    """docs/operations.md#crds-and-upgrades. label-and-annotate: installed by Helm 4 (server-side
    apply); take-ownership: client-side, as Helm 3 installed. Both with the CRD then applied by
    `kubectl apply --server-side`, as the earlier docs had users do after every upgrade."""
    group = f"{namespace}.pdserve.test"
    name = f"{PLURAL}.{group}"
    previous = previous_chart(tmp_path, group)
    current = chart_with_crd(tmp_path, crd_in_group(build_crd(), group))
    release = Release(control_plane, tmp_path, namespace)
    server_side = "true" if step == "label-and-annotate" else "false"
    try:
        release.run("install", previous, f"--server-side={server_side}")
        assert "CustomResourceDefinition" not in release.manifest()  # crds/: outside the release
        kubectl("apply", "--server-side", "-f", str(previous / "crds"), check=True)
        wait_until("the older CRD Established", lambda: established(http_api, name), timeout=30)
        uid = apply_model(http_api, group, namespace)["metadata"]["uid"]

        refused = release.helm("upgrade", release.name, str(current), "--set",
                               "webhook.enabled=false")  # fmt: skip
        assert refused.returncode != 0
        assert "invalid ownership metadata" in refused.stderr, refused.stderr
        if step == "label-and-annotate":
            kubectl("label", "crd", name, "app.kubernetes.io/managed-by=Helm", "--overwrite",
                    check=True)  # fmt: skip
            kubectl("annotate", "crd", name, "--overwrite",
                    f"meta.helm.sh/release-name={release.name}",
                    f"meta.helm.sh/release-namespace={namespace}", check=True)  # fmt: skip
            # Helm 4 (server-side) meets the fields `kubectl apply --server-side` owns.
            conflict = release.helm("upgrade", release.name, str(current), "--set",
                                    "webhook.enabled=false")  # fmt: skip
            assert 'conflict with "kubectl"' in conflict.stderr, conflict.stderr
            release.run("upgrade", current, "--force-conflicts")
        else:
            release.run("upgrade", current, "--take-ownership")

        crd = served_crd(http_api, name) or {}
        assert ADDED_FIELD in spec_properties(crd)
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == release.name
        assert "kind: CustomResourceDefinition" in release.manifest()
        # The CRD was upgraded in place, never deleted: the model is the same object.
        wait_until_a_model_keeps_the_added_field(http_api, group, namespace)
        models = f"/apis/{group}/{VERSION}/namespaces/{namespace}/{PLURAL}"
        assert http_api.get(f"{models}/sim").json()["metadata"]["uid"] == uid
    finally:
        release.uninstall(check=False)
        http_api.delete(f"{CRDS}/{name}")
