"""Names, labels and selectors of every child object (design.md "Names")."""

from __future__ import annotations

from enum import StrEnum

from pdserve.api import DisaggregatedModel

FIELD_MANAGER = "pdserve"
PARITY_HASH_ANNOTATION = "pdserve.io/parity-hash"
CONFIG_HASH_ANNOTATION = "pdserve.io/config-hash"
MODEL_LABEL = "pdserve.io/model"
SLICE_LABEL = "pdserve.io/slice"
# On engine pods, set by the operator from the slice's preflight; the gateway reads it.
KV_TRANSPORT_ANNOTATION = "pdserve.io/kv-transport"
COMPONENT_LABEL = "app.kubernetes.io/component"
INSTANCE_LABEL = "app.kubernetes.io/instance"
ENGINE_PORT = 8000
RENDER_PORT = 8000
GATEWAY_CONTAINER_PORT = 8000
# A stopping gateway keeps serving this long before SIGTERM, while kube-proxy and load balancers
# stop sending it new connections; then it finishes in-flight requests (the gateway's own
# shutdown timeout) within the rest of the grace period.
GATEWAY_DRAIN_SECONDS = 5
GATEWAY_SHUTDOWN_SECONDS = 30


class Component(StrEnum):
    prefill = "prefill"
    decode = "decode"
    render = "render"
    gateway = "gateway"
    preflight = "preflight"


def child_name(dm: DisaggregatedModel, component: Component) -> str:
    return f"{dm.name}-{component.value}"


def engine_name(dm: DisaggregatedModel, component: Component, slice_index: int) -> str:
    """One slice (the default): <cr>-prefill; more: <cr>-prefill-s<n>."""
    base = child_name(dm, component)
    return base if dm.spec.placement.slices == 1 else f"{base}-s{slice_index}"


def slice_labels(dm: DisaggregatedModel, slice_index: int) -> dict[str, str]:
    """The engine pods of one slice, prefill and decode together. With one slice no slice label
    exists (pods of models created before slices keep their template)."""
    if dm.spec.placement.slices == 1:
        return {MODEL_LABEL: dm.name}
    return {MODEL_LABEL: dm.name, SLICE_LABEL: str(slice_index)}


def selector_labels(dm: DisaggregatedModel, component: Component) -> dict[str, str]:
    """The immutable part: what Services, StatefulSets and Deployments select on."""
    return {INSTANCE_LABEL: dm.name, COMPONENT_LABEL: component.value}


def labels(dm: DisaggregatedModel, component: Component) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pdserve",
        **selector_labels(dm, component),
        "app.kubernetes.io/managed-by": "pdserve",
        MODEL_LABEL: dm.name,
    }


def meta(
    dm: DisaggregatedModel, component: Component, name: str | None = None
) -> dict[str, object]:
    return {
        "name": name or child_name(dm, component),
        "namespace": dm.namespace,
        "labels": labels(dm, component),
    }


def service_url(dm: DisaggregatedModel, component: Component, port: int) -> str:
    return f"http://{child_name(dm, component)}.{dm.namespace}.svc:{port}"
