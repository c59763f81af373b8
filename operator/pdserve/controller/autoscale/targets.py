"""Which pods of a model the autoscaling loop scrapes, and where their /metrics are."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.contract.names import COMPONENT_LABEL, ENGINE_PORT, Component


@dataclass
class Targets:
    """The metrics URLs of one model's pods, by pool and pod name."""

    render: dict[str, str] = field(default_factory=dict)
    gateway: dict[str, str] = field(default_factory=dict)
    prefill: dict[str, str] = field(default_factory=dict)
    decode: dict[str, str] = field(default_factory=dict)


TargetResolver = Callable[[Mapping[str, Any]], str | None]


def pod_metrics_url(pod: Mapping[str, Any]) -> str | None:
    """Every pdserve pod serves /metrics on its HTTP port (8000)."""
    ip = pod.get("status", {}).get("podIP")
    return f"http://{ip}:{ENGINE_PORT}/metrics" if ip else None


def targets_of(pods: Iterable[Mapping[str, Any]], resolve: TargetResolver) -> Targets:
    """Pods being deleted and pods without an address are left out."""
    found = Targets()
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        url = resolve(pod)
        component = pod["metadata"].get("labels", {}).get(COMPONENT_LABEL)
        if url is None:
            continue
        pools = (Component.render, Component.gateway, Component.prefill, Component.decode)
        if component in {c.value for c in pools}:
            getattr(found, component)[pod["metadata"]["name"]] = url
    return found
