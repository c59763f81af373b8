"""DisaggregatedModel bodies more than one test module builds on."""

from __future__ import annotations

from typing import Any

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
