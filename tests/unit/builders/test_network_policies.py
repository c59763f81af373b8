"""NetworkPolicies per model: golden manifests, who may reach which pool, and the settings that
switch them on (pruned when switched off: tests/cluster/test_network_policy.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from pdserve.api import DisaggregatedModel
from pdserve.builders import NetworkPolicyOptions, build_all, network_policies
from pdserve.cli import main
from pdserve.contract.names import ENGINE_PORT
from pdserve.controller.children import NETWORK_POLICY, list_children
from pdserve.controller.settings import add_arguments, from_arguments
from pdserve.kube.client import Kind, Kube, KubeError
from pdserve.manifests import load_resources
from pdserve.yamlio import dump_documents

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
GOLDEN = Path(__file__).parent / "golden" / "network-policies"
UPDATE = os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1"
RESTRICTED = NetworkPolicyOptions(
    metrics_namespaces=("monitoring",),
    gateway_from=(
        {"namespaceSelector": {"matchLabels": {"pdserve.io/gateway-clients": "true"}}},
        {"ipBlock": {"cidr": "10.20.0.0/16"}},
    ),
)


def example(name: str) -> DisaggregatedModel:
    [dm] = load_resources(REPO / "examples" / f"{name}.yaml")
    return dm


def check_golden(name: str, rendered: str) -> None:
    golden = GOLDEN / f"{name}.yaml"
    if UPDATE:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(rendered)
    assert golden.exists(), f"no golden file: run PDSERVE_UPDATE_GOLDEN=1 pytest {__file__}"
    assert rendered == golden.read_text(), (
        f"{name}: NetworkPolicies build differently from {golden.name}; if intended, regenerate "
        "with PDSERVE_UPDATE_GOLDEN=1 and review the diff"
    )


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_golden_network_policies(path: Path) -> None:
    [dm] = load_resources(path)
    check_golden(path.stem, dump_documents(network_policies(dm, NetworkPolicyOptions())))


def test_golden_network_policies_with_metrics_namespace_and_gateway_peers() -> None:
    dm = example("qwen2.5-7b-pd")
    check_golden("qwen2.5-7b-pd-restricted", dump_documents(network_policies(dm, RESTRICTED)))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_off_by_default_and_applied_before_the_workloads_when_on(path: Path) -> None:
    [dm] = load_resources(path)
    assert not [o for o in build_all(dm) if o["kind"] == "NetworkPolicy"]
    kinds = [o["kind"] for o in build_all(dm, network=NetworkPolicyOptions())]
    last_policy = max(i for i, kind in enumerate(kinds) if kind == "NetworkPolicy")
    first_engine = min(kinds.index(k) for k in ("StatefulSet", "LeaderWorkerSet") if k in kinds)
    assert last_policy < first_engine


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def pod_labels(dm: DisaggregatedModel) -> dict[str, dict[str, str]]:
    """Pool component -> the labels its pods carry."""
    return {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["template"]["metadata"][
            "labels"
        ]
        for o in build_all(dm)
        if o["kind"] in ("StatefulSet", "Deployment")
    }


def reachable(dm: DisaggregatedModel, options: NetworkPolicyOptions) -> dict[str, set[str]]:
    """Pool -> "<source pool>:<port or *>" for every pod-to-pod path within the model's pods that
    the policies allow (namespace and ipBlock peers listed as themselves)."""
    pods = pod_labels(dm)
    allowed: dict[str, set[str]] = {}
    for policy in network_policies(dm, options):
        [target] = [
            c for c, labels in pods.items() if selects(policy["spec"]["podSelector"], labels)
        ]
        assert policy["metadata"]["name"] == f"{dm.name}-{target}"
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        paths: set[str] = set()
        for rule in policy["spec"]["ingress"]:
            ports = [str(p["port"]) for p in rule.get("ports", [])] or ["*"]
            sources: list[str] = []
            for peer in rule.get("from", [{"anyone": True}]):
                if "podSelector" in peer and len(peer) == 1:
                    matched = [
                        c for c, labels in pods.items() if selects(peer["podSelector"], labels)
                    ]
                    assert matched, f"{target}: a peer selects no pod of the model: {peer}"
                    sources += matched
                else:
                    sources.append(next(iter(peer)))
            paths |= {f"{source}:{port}" for source in sources for port in ports}
        allowed[target] = paths
    return allowed


def test_only_the_gateway_reaches_engines_and_render_and_only_pd_pods_reach_each_other() -> None:
    http = str(ENGINE_PORT)
    assert reachable(example("qwen2.5-7b-pd"), NetworkPolicyOptions()) == {
        # P/D peers: every port (NIXL side channel 5600 + data-parallel rank, UCX's TCP ports).
        "prefill": {f"gateway:{http}", "prefill:*", "decode:*"},
        "decode": {f"gateway:{http}", "prefill:*", "decode:*"},
        "render": {f"gateway:{http}"},
        "gateway": {f"anyone:{http}"},
    }


def test_aggregated_serving_has_no_peer_rule_and_no_prefill_policy() -> None:
    assert reachable(example("render-aggregated"), NetworkPolicyOptions()) == {
        "decode": {"gateway:8000"},
        "render": {"gateway:8000"},
        "gateway": {"anyone:8000"},
    }


def test_metrics_namespaces_reach_every_pool_and_gateway_peers_replace_anyone() -> None:
    allowed = reachable(example("pd-without-render"), RESTRICTED)
    assert set(allowed) == {"prefill", "decode", "gateway"}
    for pool, paths in allowed.items():
        assert "namespaceSelector:8000" in paths, pool  # the metrics namespace (and the peer)
    # The peers, and the model's other gateway replicas (the shared long-prefill admission).
    assert allowed["gateway"] == {"gateway:8000", "namespaceSelector:8000", "ipBlock:8000"}
    [policy] = [p for p in network_policies(example("pd-without-render"), RESTRICTED)
                if p["metadata"]["name"].endswith("-decode")]  # fmt: skip
    metrics = policy["spec"]["ingress"][1]["from"][0]["namespaceSelector"]
    assert metrics["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}
    ]


def parse(argv: list[str], env: dict[str, str] | None = None) -> NetworkPolicyOptions | None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_arguments(parser.parse_args(argv), env or {}).network_policies


def test_settings_switch_network_policies_on_from_flags_or_env() -> None:
    assert parse([]) is None
    assert parse([], {"PDSERVE_NETWORK_POLICIES": "true"}) == NetworkPolicyOptions()
    assert parse(["--no-network-policies"], {"PDSERVE_NETWORK_POLICIES": "true"}) is None
    options = parse(
        ["--network-policies", "--network-policy-metrics-namespace", "monitoring",
         "--network-policy-gateway-from", '[{"ipBlock": {"cidr": "10.0.0.0/8"}}]'],
    )  # fmt: skip
    assert options == NetworkPolicyOptions(
        metrics_namespaces=("monitoring",), gateway_from=({"ipBlock": {"cidr": "10.0.0.0/8"}},)
    )
    env = {
        "PDSERVE_NETWORK_POLICIES": "true",
        "PDSERVE_NETWORK_POLICY_METRICS_NAMESPACES": "obs, monitoring",
    }
    assert parse([], env) == NetworkPolicyOptions(metrics_namespaces=("monitoring", "obs"))


GATEWAY_FROM = "--network-policy-gateway-from"
METRICS_NS = "--network-policy-metrics-namespace"


@pytest.mark.parametrize(
    ("argv", "message"),
    [([METRICS_NS, "Mon"], f"{METRICS_NS} 'Mon' is not a namespace name"),
     ([GATEWAY_FROM, "{"], f"{GATEWAY_FROM} is not JSON"),
     ([GATEWAY_FROM, "{}"], f"{GATEWAY_FROM} must be a JSON list"),
     ([GATEWAY_FROM, '[{"pods": {}}]'], rf"{GATEWAY_FROM}\[0\] has pods"),
     ([GATEWAY_FROM, '[{}, {"ipBlock": {}}]'], rf"{GATEWAY_FROM}\[0\] must be a NetworkPolicyPeer"),
     ([GATEWAY_FROM, '[{"ipBlock": {}}]'], rf"{GATEWAY_FROM}\[0\].ipBlock.cidr is required"),
     ([GATEWAY_FROM, '[{"podSelector": []}]'], rf"{GATEWAY_FROM}\[0\].podSelector must be an obj")],
)  # fmt: skip
def test_bad_network_policy_settings_name_the_setting(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(["--network-policies", *argv])


def test_a_bad_switch_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match="PDSERVE_NETWORK_POLICIES must be true or false"):
        parse([], {"PDSERVE_NETWORK_POLICIES": "maybe"})


def test_manifests_command_prints_the_policies_when_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = str(REPO / "examples" / "render-aggregated.yaml")
    assert main(["manifests", "-f", path]) == 0
    assert "kind: NetworkPolicy" not in capsys.readouterr().out
    assert main(["manifests", "-f", path, "--network-policies"]) == 0
    assert capsys.readouterr().out.count("kind: NetworkPolicy") == 3  # decode, render, gateway
    assert main(["manifests", "-f", path, "--network-policies", GATEWAY_FROM, "[1]"]) == 2
    assert f"{GATEWAY_FROM}[0] must be a NetworkPolicyPeer object" in capsys.readouterr().err


class ForbiddenNetworkPolicies:
    """A Kube whose user may list everything but NetworkPolicies (RBAC without the option)."""

    async def list(self, kind: Kind, namespace: str, **_: Any) -> list[dict[str, Any]]:
        if kind == NETWORK_POLICY:
            request = httpx.Request("GET", f"https://api{kind.collection(namespace)}")
            raise KubeError(httpx.Response(403, json={"message": "forbidden"}, request=request))
        return []


async def test_switched_off_a_forbidden_network_policy_list_is_skipped_not_fatal() -> None:
    kube = cast(Kube, ForbiddenNetworkPolicies())
    optional = frozenset({NETWORK_POLICY})
    assert await list_children(kube, "ns", "m", optional=optional) == {}
    with pytest.raises(KubeError, match="403"):  # switched on, the permission is required
        await list_children(kube, "ns", "m")


def test_the_operators_own_namespace_may_always_scrape_the_pools() -> None:
    """The operator scrapes decode engines' NIXL metrics (TransportHealthy) and the Builtin
    autoscaler's signals: its policies never shut it out, named or not."""
    env = {"PDSERVE_NETWORK_POLICIES": "true", "PDSERVE_OPERATOR_NAMESPACE": "pdserve-system"}
    options = parse([], env)
    assert options is not None
    assert options.metrics_namespaces == ("pdserve-system",)
    named = parse(["--network-policy-metrics-namespace", "monitoring"], env)
    assert named is not None
    assert named.metrics_namespaces == ("monitoring", "pdserve-system")
