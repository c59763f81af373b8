"""The tiny test model (devtools/tiny_model.py) as a user's model reaches pods: a
PersistentVolumeClaim that `spec.model.source.pvc` names, bound to a statically provisioned
PersistentVolume. On the one real node, the volume is a hostPath PersistentVolume of the model's
directory in the cache, read-only; on a real cluster it would be NFS, a CSI driver or a
pre-populated block volume, and the claim and the DisaggregatedModel stay as they are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# examples/vllm-cpu-tiny.yaml names this claim (spec.model.source.pvc.claimName).
CLAIM_NAME = "tiny-qwen3-model"
# A model of a few MiB: the size only has to cover it for the binder.
CAPACITY = "1Gi"


def model_volume(model_dir: Path, namespace: str, claim: str = CLAIM_NAME) -> list[dict[str, Any]]:
    """A PersistentVolume of `model_dir` reserved for `namespace`/`claim`, and that claim:
    ReadOnlyMany (every render, prefill and decode pod mounts it) with no storage class, so the
    controller-manager's binder binds the two and no provisioner is asked."""
    volume = f"{namespace}-{claim}"
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume, "labels": {"app.kubernetes.io/part-of": "pdserve-demo"}},
            "spec": {
                "capacity": {"storage": CAPACITY},
                "accessModes": ["ReadOnlyMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "hostPath": {"path": str(model_dir), "type": "Directory"},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": CAPACITY}},
            },
        },
    ]
