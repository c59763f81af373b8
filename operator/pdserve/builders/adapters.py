"""The engine pods' LoRA adapters (spec.model.adapters): every adapter at the same path in every
pod (api/adapters.py ADAPTERS_DIR/<name>), mounted from its claim or downloaded from the Hub at
its revision by an init container before vLLM starts (vLLM's own download of an adapter takes no
revision, so pods started a day apart could hold different adapters under one name)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.api import DisaggregatedModel

DOWNLOADS_VOLUME = "lora-downloads"
# requests == limits: an engine pod asked to be Guaranteed stays so (every container counts).
DOWNLOAD_RESOURCES = {"cpu": "1", "memory": "1Gi"}
DOWNLOADS_MOUNT = "/pdserve/lora-downloads"
# Runs in the engine image (huggingface_hub comes with vLLM): each (repo, revision, name) is
# downloaded into DOWNLOADS_MOUNT/<name>; a failure exits non-zero with the Hub's own words, so
# the pod shows Init:Error / Init:CrashLoopBackOff naming the adapter that failed.
DOWNLOAD_SCRIPT = """\
import sys
from huggingface_hub import snapshot_download
into, *args = sys.argv[1:]
for repo, revision, name in zip(args[0::3], args[1::3], args[2::3]):
    print(f"adapter {name}: {repo} at {revision}", flush=True)
    snapshot_download(repo_id=repo, revision=revision, local_dir=f"{into}/{name}")
"""


@dataclass
class AdapterMounts:
    """What the engine pod template gets for its adapters."""

    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def claim_volume(claim: str) -> str:
    """One volume per claim, however many adapters it holds."""
    return f"lora-claim-{claim}"[:63].rstrip("-.")


def adapter_mounts(dm: DisaggregatedModel, env: list[dict[str, Any]]) -> AdapterMounts:
    """Volumes and mounts putting each adapter at its path; the init container downloading the
    Hub's, with `env` (the engine container's Hugging Face token, endpoint and proxies) less
    HF_HUB_OFFLINE (set when the model itself comes from a claim)."""
    out = AdapterMounts()
    claims: list[str] = []
    downloads: list[str] = []
    for adapter in dm.spec.model.adapters:
        if adapter.pvc is not None:
            volume = claim_volume(adapter.pvc.claim_name)
            if adapter.pvc.claim_name not in claims:
                claims.append(adapter.pvc.claim_name)
                out.volumes.append({"name": volume, "persistentVolumeClaim": {
                    "claimName": adapter.pvc.claim_name, "readOnly": True}})  # fmt: skip
            mount = {"name": volume, "mountPath": adapter.path, "readOnly": True}
            if adapter.pvc.path not in (".", ""):
                mount["subPath"] = adapter.pvc.path.rstrip("/")
            out.mounts.append(mount)
        elif adapter.hf is not None:
            downloads += [adapter.hf.repo, adapter.hf.revision, adapter.name]
            out.mounts.append({"name": DOWNLOADS_VOLUME, "mountPath": adapter.path,
                               "subPath": adapter.name, "readOnly": True})  # fmt: skip
    if downloads:
        out.volumes.append({"name": DOWNLOADS_VOLUME, "emptyDir": {}})
        out.init_containers.append({
            "name": "lora-adapters",
            "image": dm.spec.image.engine,
            "imagePullPolicy": dm.spec.image.pull_policy,
            "command": ["python3", "-c", DOWNLOAD_SCRIPT, DOWNLOADS_MOUNT, *downloads],
            "env": [var for var in env if var["name"] != "HF_HUB_OFFLINE"],
            "resources": {"requests": dict(DOWNLOAD_RESOURCES), "limits": dict(DOWNLOAD_RESOURCES)},
            "volumeMounts": [{"name": DOWNLOADS_VOLUME, "mountPath": DOWNLOADS_MOUNT}],
        })  # fmt: skip
    return out
