"""Engine placement builders: GPU products, topology domains and slices, RDMA, Guaranteed QoS."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pdserve.api import DisaggregatedModel, SpecError, parse_resource
from pdserve.builders import build_all
from tests.support.specs import GPU_POOLS as BASE

DOMAIN = {"topologyKey": "nvidia.com/gpu.clique"}


def model(**placement: Any) -> DisaggregatedModel:
    body = copy.deepcopy(BASE)
    body["spec"]["placement"] = placement
    return parse_resource(body)


def statefulsets(dm: DisaggregatedModel) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in build_all(dm) if o["kind"] == "StatefulSet"}


def pod_spec(sts: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = sts["spec"]["template"]["spec"]
    return spec


def test_one_slice_keeps_the_names_and_selectors_models_always_had() -> None:
    sets = statefulsets(model(domain=DOMAIN))
    assert sorted(sets) == ["m-decode", "m-prefill"]
    decode = sets["m-decode"]
    assert "pdserve.io/slice" not in decode["spec"]["template"]["metadata"]["labels"]
    assert decode["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/instance": "m", "app.kubernetes.io/component": "decode",
    }  # fmt: skip
    # Every engine pod of the model in one domain.
    assert pod_spec(decode)["affinity"] == {"podAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {"pdserve.io/model": "m"}},
            "topologyKey": "nvidia.com/gpu.clique",
        }],
    }}  # fmt: skip


def test_each_slice_gets_its_own_statefulsets_kept_together_and_spread() -> None:
    dm = model(slices=2, domain={**DOMAIN, "spreadSlices": "Required"})
    sets = statefulsets(dm)
    assert sorted(sets) == ["m-decode-s0", "m-decode-s1", "m-prefill-s0", "m-prefill-s1"]
    s1 = sets["m-prefill-s1"]
    assert (s1["spec"]["replicas"], sets["m-decode-s1"]["spec"]["replicas"]) == (1, 2)
    assert s1["spec"]["serviceName"] == "m-prefill"  # one headless Service per pool
    assert s1["spec"]["selector"]["matchLabels"]["pdserve.io/slice"] == "1"
    assert s1["spec"]["template"]["metadata"]["labels"]["pdserve.io/slice"] == "1"
    affinity = pod_spec(s1)["affinity"]
    [together] = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert together["labelSelector"]["matchLabels"] == {
        "pdserve.io/model": "m", "pdserve.io/slice": "1",
    }  # fmt: skip
    [apart] = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert apart["labelSelector"]["matchExpressions"] == [
        {"key": "pdserve.io/slice", "operator": "NotIn", "values": ["1"]}
    ]
    services = [o for o in build_all(dm) if o["kind"] == "Service"]
    assert sorted(s["metadata"]["name"] for s in services) == [
        "m-decode", "m-gateway", "m-prefill", "m-render",
    ]  # fmt: skip


def test_preferred_domain_and_same_node_mode() -> None:
    dm = model(domain={"topologyKey": "kubernetes.io/hostname", "mode": "Preferred"})
    affinity = pod_spec(statefulsets(dm)["m-decode"])["affinity"]
    [term] = affinity["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["weight"] == 100
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def test_gpu_products_join_every_node_selector_term_of_the_users_affinity() -> None:
    users = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]},
            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["b"]}]},
        ]}}}  # fmt: skip
    dm = model(gpuProducts=["NVIDIA-H200"], affinity=users)
    terms = pod_spec(statefulsets(dm)["m-prefill"])["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]  # fmt: skip
    product = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H200"]}
    assert [t["matchExpressions"][-1] for t in terms] == [product, product]
    assert [t["matchExpressions"][0]["values"] for t in terms] == [["a"], ["b"]]
    assert dm.spec.placement.affinity == users  # the spec itself is not modified


def test_rdma_is_requested_only_when_asked() -> None:
    plain = statefulsets(model())["m-decode"]
    container = pod_spec(plain)["containers"][0]
    assert "securityContext" not in container
    assert container["resources"] == {
        "requests": {"cpu": "4", "memory": "32Gi"}, "limits": {"nvidia.com/gpu": "1"},
    }  # fmt: skip
    assert "hostNetwork" not in pod_spec(plain)
    assert "k8s.v1.cni.cncf.io/networks" not in plain["spec"]["template"]["metadata"]["annotations"]

    rdma = {"resource": "rdma/rdma_shared_device_a", "networks": ["roce-a", "roce-b"]}
    decode = statefulsets(model(rdma=rdma))["m-decode"]
    container = pod_spec(decode)["containers"][0]
    assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    # Guaranteed QoS by default with RDMA: requests == limits for CPU and memory.
    assert container["resources"] == {
        "requests": {"cpu": "4", "memory": "32Gi"},
        "limits": {"cpu": "4", "memory": "32Gi", "nvidia.com/gpu": "1",
                   "rdma/rdma_shared_device_a": "1"},
    }  # fmt: skip
    annotations = decode["spec"]["template"]["metadata"]["annotations"]
    assert annotations["k8s.v1.cni.cncf.io/networks"] == "roce-a,roce-b"
    assert "hostNetwork" not in pod_spec(decode)

    hosted = statefulsets(model(rdma={**rdma, "hostNetwork": True}))["m-prefill"]
    assert (pod_spec(hosted)["hostNetwork"], pod_spec(hosted)["dnsPolicy"]) == (
        True, "ClusterFirstWithHostNet",
    )  # fmt: skip


def test_ucx_transports_reach_both_engines() -> None:
    body = copy.deepcopy(BASE)
    body["spec"]["kvTransfer"] = {"ucxTransports": "rc,cuda_copy"}
    body["spec"]["placement"] = {"rdma": {"resource": "rdma/hca"}, "guaranteedQoS": False}
    for sts in statefulsets(parse_resource(body)).values():
        env = {e["name"]: e.get("value") for e in pod_spec(sts)["containers"][0]["env"]}
        assert env["UCX_TLS"] == "rc,cuda_copy"


@pytest.mark.parametrize(
    ("placement", "pool_resources", "message"),
    [
        ({"slices": 2}, None, "slices is 2 but domain is unset: set placement.domain.topologyKey"),
        # On GPUs an unset memory gets its per-GPU default; CPU engines have none to take.
        ({"guaranteedQoS": True, "acceleratorResource": ""}, {"requests": {"cpu": "4"}},
         "spec.decode.resources.requests.memory is needed: placement.guaranteedQoS"),
        ({"guaranteedQoS": True}, {"requests": {"cpu": "4", "memory": "1Gi"},
                                   "limits": {"memory": "2Gi"}},
         r"requests.memory \(1Gi\) differs from limits.memory \(2Gi\)"),
        ({"rdma": {"resource": "rdma/hca"}, "guaranteedQoS": False},
         {"limits": {"rdma/hca": "1"}},
         r"spec.decode.resources.limits\[rdma/hca\] is derived from placement.rdma.count"),
        ({"domain": {"topologyKey": "not a label"}}, None, "topologyKey"),
    ],
)  # fmt: skip
def test_bad_placement_names_the_field(
    placement: dict[str, Any], pool_resources: dict[str, Any] | None, message: str
) -> None:
    body = copy.deepcopy(BASE)
    body["spec"]["placement"] = placement
    if pool_resources is not None:
        body["spec"]["decode"]["resources"] = pool_resources
    with pytest.raises(SpecError, match=message):
        parse_resource(body)


def test_ucx_tls_in_env_points_to_the_field() -> None:
    body = copy.deepcopy(BASE)
    body["spec"]["decode"]["env"] = [{"name": "UCX_TLS", "value": "tcp"}]
    with pytest.raises(SpecError, match=r"derived from spec\.kvTransfer\.ucxTransports"):
        parse_resource(body)


def test_resource_claims_reach_every_engine_pod_and_its_vllm_container() -> None:
    """GB200 NVL72: NVLink across trays needs the IMEX channel of a DRA ComputeDomain."""
    claim = {"name": "imex", "resourceClaimTemplateName": "nvl72-channel"}
    dm = model(resourceClaims=[claim])
    engines = statefulsets(dm)
    assert len(engines) == 2
    for engine in engines.values():
        pod = pod_spec(engine)
        assert pod["resourceClaims"] == [claim]
        [vllm] = pod["containers"]
        assert vllm["resources"]["claims"] == [{"name": "imex"}]
    others = [o for o in build_all(dm) if o["kind"] == "Deployment"]
    assert all("resourceClaims" not in o["spec"]["template"]["spec"] for o in others)
