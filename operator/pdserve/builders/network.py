"""NetworkPolicies of one model (optional: operator setting `--network-policies`).

Ingress only (egress stays open: engines download weights, the gateway calls the pools):
- prefill/decode: HTTP (inference and /metrics) from the model's gateway pods only; from the
  model's own prefill and decode pods on every port: the NIXL side channel
  (kvTransfer.sideChannelPort + data-parallel rank) and the KV data itself, which UCX over TCP
  sends on ports it picks at run time (RDMA bypasses NetworkPolicies altogether) and the
  simulator carries over its HTTP port. Nothing else reaches the engines, which have no auth.
- render: HTTP from the model's gateway pods only.
- gateway: its port from anywhere, or from the configured peers and the model's other gateway
  replicas only (they share the long-prefill admission through each other's /admission).
- every pool: HTTP from the metrics namespaces (Prometheus scrapes /metrics on the HTTP port, so
  a scraper there can reach the whole HTTP API too: list only the monitoring namespace).

Kubelet probes are not affected: traffic from a pod's own node is always allowed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.builders.names import meta
from pdserve.contract.names import (
    COMPONENT_LABEL,
    ENGINE_PORT,
    GATEWAY_CONTAINER_PORT,
    MODEL_LABEL,
    RENDER_PORT,
    Component,
)

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
PEER_KEYS = frozenset({"podSelector", "namespaceSelector", "ipBlock"})


@dataclass(frozen=True)
class NetworkPolicyOptions:
    """What the operator settings add to the per-model policies."""

    metrics_namespaces: tuple[str, ...] = ()
    """Namespaces whose pods may scrape every pool's /metrics (the HTTP port)."""
    gateway_from: tuple[Mapping[str, Any], ...] = ()
    """NetworkPolicyPeers (podSelector, namespaceSelector, ipBlock) allowed to reach the
    gateway; empty: anyone (in and outside the cluster)."""


def _pods(dm: DisaggregatedModel, *components: Component) -> dict[str, Any]:
    """A label selector for the model's pods of these components."""
    if len(components) == 1:
        return {"matchLabels": {MODEL_LABEL: dm.name, COMPONENT_LABEL: components[0].value}}
    return {
        "matchLabels": {MODEL_LABEL: dm.name},
        "matchExpressions": [
            {"key": COMPONENT_LABEL, "operator": "In", "values": [c.value for c in components]}
        ],
    }


def _tcp(port: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port}]


def _metrics_rule(options: NetworkPolicyOptions, port: int) -> list[dict[str, Any]]:
    if not options.metrics_namespaces:
        return []
    namespaces = sorted(set(options.metrics_namespaces))
    return [{
        "from": [{"namespaceSelector": {"matchExpressions": [
            {"key": NAMESPACE_NAME_LABEL, "operator": "In", "values": namespaces},
        ]}}],
        "ports": _tcp(port),
    }]  # fmt: skip


def _policy(
    dm: DisaggregatedModel, component: Component, ingress: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(dm, component),
        "spec": {
            "podSelector": _pods(dm, component),
            "policyTypes": ["Ingress"],
            "ingress": [dict(rule) for rule in ingress],
        },
    }


def network_policies(dm: DisaggregatedModel, options: NetworkPolicyOptions) -> list[dict[str, Any]]:
    """One NetworkPolicy per pool of the model, named like the pool."""
    from_gateway = [{"podSelector": _pods(dm, Component.gateway)}]
    engines = [Component.decode]
    if dm.spec.disaggregated:
        engines.insert(0, Component.prefill)
    policies = []
    for engine in engines:
        rules: list[dict[str, Any]] = [{"from": from_gateway, "ports": _tcp(ENGINE_PORT)}]
        rules += _metrics_rule(options, ENGINE_PORT)
        if dm.spec.disaggregated:
            # Every port, see the module docstring: side channel + the connector's data plane.
            rules.append(
                {"from": [{"podSelector": _pods(dm, Component.prefill, Component.decode)}]}
            )
        policies.append(_policy(dm, engine, rules))
    if dm.spec.render.enabled:
        rules = [{"from": from_gateway, "ports": _tcp(RENDER_PORT)}]
        policies.append(_policy(dm, Component.render, rules + _metrics_rule(options, RENDER_PORT)))
    if options.gateway_from:
        peers = [*from_gateway, *(dict(peer) for peer in options.gateway_from)]
        gateway_rules = [{"from": peers, "ports": _tcp(GATEWAY_CONTAINER_PORT)}]
        gateway_rules += _metrics_rule(options, GATEWAY_CONTAINER_PORT)
    else:
        gateway_rules = [{"ports": _tcp(GATEWAY_CONTAINER_PORT)}]  # from anywhere
    policies.append(_policy(dm, Component.gateway, gateway_rules))
    return policies


def check_peer(index: int, peer: object) -> Mapping[str, Any]:
    """A NetworkPolicyPeer given in the operator settings; ValueError names the entry."""
    where = f"--network-policy-gateway-from[{index}]"
    if not isinstance(peer, Mapping) or not peer:
        raise ValueError(f"{where} must be a NetworkPolicyPeer object, got {peer!r}")
    unknown = sorted(set(peer) - PEER_KEYS)
    if unknown:
        raise ValueError(
            f"{where} has {', '.join(unknown)}; a NetworkPolicyPeer has only "
            f"{', '.join(sorted(PEER_KEYS))}"
        )
    if "ipBlock" in peer and len(peer) > 1:
        raise ValueError(f"{where}: ipBlock cannot be combined with a selector")
    for key, value in peer.items():
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}.{key} must be an object, got {value!r}")
    if "ipBlock" in peer and not isinstance(peer["ipBlock"].get("cidr"), str):
        raise ValueError(f"{where}.ipBlock.cidr is required (e.g. 10.0.0.0/8)")
    return peer
