"""Admission warnings: a spec that is allowed but that a user should hear about before pods
exist."""

from __future__ import annotations

from pdserve.api import parse_resource
from pdserve.api.advice import admission_warnings
from tests.unit.api.test_api import resource

RDMA = {"resource": "rdma/rdma_shared_device_a"}
GUARANTEED = {"requests": {"cpu": "8", "memory": "64Gi"}}


def warnings_for(**spec: object) -> list[str]:
    return admission_warnings(parse_resource(resource(**spec)).spec)


def test_one_nic_pinned_for_a_multi_gpu_pod_is_named_per_pool() -> None:
    found = warnings_for(
        kvTransfer={"ucxNetDevices": "mlx5_0:1"},
        placement={"rdma": RDMA},
        prefill={"tensorParallelSize": 2, "resources": GUARANTEED},
        decode={"resources": GUARANTEED},
    )
    assert found == [
        "spec.kvTransfer.ucxNetDevices mlx5_0:1 sends the KV of all 2 GPUs of each spec.prefill "
        "pod through one NIC (UCX_NET_DEVICES applies to every rank; on 8-NIC HGX nodes each "
        "GPU has its own) and under SR-IOV the name inside the pod differs from the host's: "
        "leave it unset (UCX picks the NIC nearest each GPU) or list every NIC"
    ]
    listed = {"ucxNetDevices": "mlx5_0:1,mlx5_1:1"}
    assert warnings_for(kvTransfer=listed, placement={"rdma": RDMA, "guaranteedQoS": False},
                        prefill={"tensorParallelSize": 2}) == []  # fmt: skip


def test_a_clique_domain_without_known_products_warns_and_on_gb200_asks_for_imex() -> None:
    [unknown] = warnings_for(placement={"domain": {}})
    assert "publishes it only on multi-node NVLink systems" in unknown
    assert "engine pods would wait Pending" in unknown
    [gb200] = warnings_for(placement={"domain": {}, "gpuProducts": ["NVIDIA-GB200"]})
    assert "IMEX channels" in gb200
    claim = {"name": "imex", "resourceClaimTemplateName": "nvl72-channel"}
    gb200_with_imex = {"domain": {}, "gpuProducts": ["NVIDIA-GB200"], "resourceClaims": [claim]}
    whole_trays = {"tensorParallelSize": 4}
    assert warnings_for(placement=gb200_with_imex, decode=whole_trays) == []
    assert warnings_for(placement={"domain": {"topologyKey": "kubernetes.io/hostname"}}) == []


def test_a_plain_spec_has_no_warnings() -> None:
    assert warnings_for() == []


def test_an_unknown_model_from_the_hub_warns_that_its_download_is_unsized() -> None:
    [unsized] = warnings_for(model={"name": "acme/secret-70b"})
    assert unsized.startswith("spec.model.source: acme/secret-70b downloads from the Hugging")
    assert (
        warnings_for(model={"name": "acme/secret-70b", "source": {"pvc": {"claimName": "w"}}}) == []
    )
    assert warnings_for(model={"name": "acme/x"}, placement={"acceleratorResource": ""}) == []


def test_a_channel_claim_on_a_part_of_a_gb200_tray_warns_that_the_rest_idles() -> None:
    claim = {"name": "imex", "resourceClaimTemplateName": "nvl72-channel"}
    placement = {"domain": {}, "gpuProducts": ["NVIDIA-GB200"], "resourceClaims": [claim]}
    [warning] = warnings_for(placement=placement, decode={"tensorParallelSize": 2})
    assert warning.startswith("spec.decode: 2 GPUs per pod on NVIDIA-GB200 nodes of 4")
    assert warning.endswith("use tensorParallelSize x dataParallelSize = 4")
    assert warnings_for(placement=placement, decode={"tensorParallelSize": 4}) == []
