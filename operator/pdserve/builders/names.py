"""Names, labels and selectors of every child object (docs/architecture.md); the constants they
use are the cluster contract (pdserve.contract.names)."""

from __future__ import annotations

from pdserve.api import DisaggregatedModel
from pdserve.contract.names import (
    COMPONENT_LABEL,
    INSTANCE_LABEL,
    MODEL_LABEL,
    SLICE_LABEL,
    Component,
)


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
