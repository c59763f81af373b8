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


# What an engine pod on GPUs requests per GPU (tensorParallelSize x dataParallelSize) for the
# CPU and memory its pool leaves unset, so no engine runs BestEffort (the first evicted under
# node memory pressure, with no CPU share at all). CPU: vLLM runs an API server, an engine core
# and one worker per GPU, each keeping about a core busy (TP 1 runs the worker inside the
# engine core). Memory: 16 GiB per GPU, llm-d's P/D guide's figure (16 Gi for a TP=1 prefill, 64
# Gi for a TP=4 decode): host-side loading of weight shards, pinned staging buffers, NIXL's
# registered buffers, and /dev/shm (a memory-backed volume). They are floors, not caps (no
# limit is derived), except under Guaranteed QoS, which makes limits equal to them.
ENGINE_CPU_PER_GPU = 2
ENGINE_MEMORY_GIB_PER_GPU = 16


def engine_default_resources(spec: ResourceRequirements, gpus: int) -> ResourceRequirements:
    """`spec` with a CPU and a memory request per GPU added where it sets neither a request nor
    a limit (a limit alone makes Kubernetes request the limit)."""
    defaults = {
        "cpu": str(ENGINE_CPU_PER_GPU * gpus),
        "memory": f"{ENGINE_MEMORY_GIB_PER_GPU * gpus}Gi",
    }
    requests = dict(spec.requests)
    for resource, quantity in defaults.items():
        if resource not in spec.requests and resource not in spec.limits:
            requests[resource] = quantity
    return spec.model_copy(update={"requests": requests})


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
