"""Container resources: requests and limits, Guaranteed QoS, CPU quantities in cores."""

from __future__ import annotations

from pydantic import Field

from pdserve.api.base import ApiModel
from pdserve.api.common import Quantity

GPU_RESOURCE = "nvidia.com/gpu"


class ResourceRequirements(ApiModel):
    """CPU, memory and other resources, as in a container's resources."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Requested resources."""
    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Resource limits."""


def guaranteed_resources(pool: str, spec: ResourceRequirements) -> dict[str, Quantity]:
    """CPU and memory for requests == limits; refuses what cannot be made Guaranteed."""
    out: dict[str, Quantity] = {}
    for resource in ("cpu", "memory"):
        request, limit = spec.requests.get(resource), spec.limits.get(resource)
        if request is None and limit is None:
            raise ValueError(
                f"spec.{pool}.resources.requests.{resource} is needed: placement.guaranteedQoS "
                "(on by default with placement.rdma) makes requests == limits; set it, or set "
                "placement.guaranteedQoS: false"
            )
        if request is not None and limit is not None and str(request) != str(limit):
            raise ValueError(
                f"spec.{pool}.resources: requests.{resource} ({request}) differs from "
                f"limits.{resource} ({limit}), but placement.guaranteedQoS needs them equal"
            )
        out[resource] = request if request is not None else limit  # type: ignore[assignment]
    return out


def cpu_cores(quantity: Quantity | None) -> float | None:
    """A CPU quantity in cores: "250m" -> 0.25, "2" or 2 -> 2.0; None when unset or unreadable."""
    if quantity is None:
        return None
    text = str(quantity).strip()
    try:
        return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        return None
