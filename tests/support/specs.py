"""DisaggregatedModel bodies more than one test module builds on."""

from __future__ import annotations

import copy
from typing import Any

from pdserve.api import DisaggregatedModel, parse_resource

# Prefill and decode pools with CPU and memory requests, as GPU placement tests need them.
GPU_POOLS: dict[str, Any] = {
    "apiVersion": "pdserve.io/v1alpha1",
    "kind": "DisaggregatedModel",
    "metadata": {"name": "m", "namespace": "ns"},
    "spec": {
        "model": {"name": "org/model"},
        "prefill": {"replicas": 1, "resources": {"requests": {"cpu": "8", "memory": "64Gi"}}},
        "decode": {"replicas": 2, "resources": {"requests": {"cpu": "4", "memory": "32Gi"}}},
    },
}


def autoscaled_model(**spec: Any) -> DisaggregatedModel:
    """A P/D model with TTFT and ITL SLOs (what the engine autoscaling rules judge against), its
    spec updated with `spec`."""
    body: dict[str, Any] = {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "DisaggregatedModel",
        "metadata": {"name": "qwen", "namespace": "llm"},
        "spec": {"model": {"name": "Qwen/Qwen3-8B"}, "prefill": {"replicas": 1},
                 "gateway": {"slo": {"ttftMs": 2000, "itlMs": 50}}},
    }  # fmt: skip
    body["spec"].update(copy.deepcopy(spec))
    return parse_resource(body)


def spec_with(base: dict[str, Any], **changes: Any) -> DisaggregatedModel:
    """`base` parsed, its spec changed by `pool__field=value` (a path dotted by `__`)."""
    body = copy.deepcopy(base)
    for dotted, value in changes.items():
        node = body["spec"]
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return parse_resource(body)
