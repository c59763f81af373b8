"""The DisaggregatedModel API: defaults, and every validation error naming its field and fix."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pdserve.api import PARITY_ENV, PARITY_FLAGS, SpecError, parse_resource


def resource(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "DisaggregatedModel",
        "metadata": {"name": "qwen", "namespace": "llm"},
        "spec": {"model": {"name": "Qwen/Qwen2.5-7B-Instruct"}},
    }
    body["spec"].update(copy.deepcopy(spec))
    return body


def problems(body: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_resource(body)
    return caught.value.problems


def test_minimal_spec_gets_sane_defaults() -> None:
    dm = parse_resource(resource())
    spec = dm.spec
    assert dm.served_model_name == "qwen"
    assert not spec.disaggregated  # no prefill pool: aggregated on decode
    assert spec.decode.replicas == 1
    assert spec.decode.gpus == 1
    assert spec.render.enabled
    assert spec.render.autoscaling.enabled
    assert spec.kv_transfer.connector == "NixlConnector"
    assert spec.kv_transfer.load_failure_policy is None  # vLLM's own default applies
    assert spec.serving.block_size is None  # derived from the engines' backend:
    assert spec.block_size == 16  # GPU engines, vLLM's GPU default
    assert spec.gateway.routing.mode == "Auto"


@pytest.mark.parametrize(
    ("placement", "serving", "expected"),
    [
        ({}, {}, 16),
        ({"acceleratorResource": "amd.com/gpu"}, {}, 16),
        ({"acceleratorResource": ""}, {}, 128),
        ({}, {"blockSize": 16}, 16),
        ({}, {"blockSize": 1}, 1),
        ({"acceleratorResource": ""}, {"blockSize": 64}, 64),
        ({"acceleratorResource": ""}, {"blockSize": 32}, 32),
    ],
)
def test_block_size_is_vllms_default_for_the_engines_backend_unless_set(
    placement: dict[str, Any], serving: dict[str, Any], expected: int
) -> None:
    """Unset: 128 on CPU engines (what vLLM's CPU platform picks), 16 on accelerators."""
    spec = parse_resource(resource(placement=placement, serving=serving)).spec
    assert spec.block_size == expected
    assert spec.serving.block_size == serving.get("blockSize")


@pytest.mark.parametrize("size", [1, 8, 16])
def test_cpu_engines_refuse_a_block_size_their_backend_cannot_run(size: int) -> None:
    [problem] = problems(
        resource(placement={"acceleratorResource": ""}, serving={"blockSize": size})
    )
    assert problem.startswith(f"spec.serving.blockSize {size} on CPU engines")
    assert problem.endswith("use 32, 64 or 128, or leave it unset for 128")


def test_prefill_pool_with_replicas_means_disaggregated() -> None:
    assert parse_resource(resource(prefill={})).spec.disaggregated
    assert not parse_resource(resource(prefill={"replicas": 0})).spec.disaggregated


def test_gpus_per_pod_are_tensor_times_data_parallel() -> None:
    spec = parse_resource(resource(decode={"tensorParallelSize": 2, "dataParallelSize": 4})).spec
    assert spec.decode.gpus == 8


def test_camel_case_json_round_trips() -> None:
    body = resource(
        serving={"toolCallParser": "hermes", "enableAutoToolChoice": True},
        render={"autoscaling": {"targetCPUUtilizationPercentage": 55}},
        kvTransfer={"loadFailurePolicy": "recompute", "leaseDurationSeconds": 90},
    )
    spec_json = parse_resource(body).spec.to_json()
    assert spec_json["serving"]["enableAutoToolChoice"] is True
    assert spec_json["render"]["autoscaling"]["targetCPUUtilizationPercentage"] == 55
    assert spec_json["kvTransfer"]["loadFailurePolicy"] == "recompute"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"decode": {"replicas": -1}}, "spec.decode.replicas: Input should be greater than or equal to 0"),
        ({"decode": {"tensorParallelSize": 0}}, "spec.decode.tensorParallelSize: Input should be greater"),
        ({"decode": {"gpuMemoryUtilization": 1.5}}, "spec.decode.gpuMemoryUtilization: Input should be less than or equal to 1"),
        ({"render": {"workers": 0}}, "spec.render.workers: Input should be greater than or equal to 1"),
        ({"render": {"engineApi": "Text"}}, "spec.render.engineApi: Input should be 'ScaleOut' or 'TokensOnly'"),
        ({"render": {"enabled": False, "engineApi": "TokensOnly"}}, "spec.render: engineApi TokensOnly needs the render pool (enabled: true): without one the engines speak OpenAI and load a tokenizer; set enabled: true, or drop engineApi"),
        ({"decode": {"extraArgs": ["--enable-scale-out"]}}, "spec.decode.extraArgs[0] sets --enable-scale-out, which is derived from spec.render.engineApi (ScaleOut); set it there instead"),
        ({"prefill": {"extraArgs": ["--tokens-only"]}}, "spec.prefill.extraArgs[0] sets --tokens-only, which is derived from spec.render.engineApi (TokensOnly); set it there instead"),
        ({"render": {"autoscaling": {"minReplicas": 4, "maxReplicas": 2}}}, "spec.render.autoscaling: maxReplicas (2) must be >= minReplicas (4)"),
        ({"serving": {"enableAutoToolChoice": True}}, "spec.serving: enableAutoToolChoice needs toolCallParser: set spec.serving.toolCallParser"),
        ({"serving": {"blockSize": 12}}, "spec.serving.blockSize: Input should be 1, 8, 16, 32, 64 or 128"),
        ({"serving": {"blockSize": 16}, "placement": {"acceleratorResource": ""}}, "spec.serving.blockSize 16 on CPU engines (spec.placement.acceleratorResource \"\"): vLLM's CPU backend needs a multiple of 32; use 32, 64 or 128, or leave it unset for 128"),
        ({"serving": {"kvCacheDtype": "int4"}}, "spec.serving.kvCacheDtype: Input should be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2'"),
        ({"kvTransfer": {"connector": "LMCacheConnectorV1", "loadFailurePolicy": "fail"}}, "spec.kvTransfer: loadFailurePolicy needs a NIXL connector"),
        ({"kvTransfer": {"connector": "MooncakeConnector", "bidirectional": True}}, "spec.kvTransfer: bidirectional needs a NIXL connector"),
        ({"kvTransfer": {"extraConfig": {"kv_lease_duration": 5}}}, "spec.kvTransfer: extraConfig.kv_lease_duration is set by kvTransfer.leaseDurationSeconds"),
        ({"kvTransfer": {"connector": "TcpConnector"}}, "spec.kvTransfer.connector: Input should be 'NixlConnector'"),
        ({"kvTransfer": {"decodeBlocksTtlSeconds": 600}}, "spec.kvTransfer: decodeBlocksTtlSeconds needs bidirectional: true"),
        ({"kvTransfer": {"bidirectional": True, "extraConfig": {"decoder_kv_blocks_ttl": 60}}}, "spec.kvTransfer: extraConfig.decoder_kv_blocks_ttl is set by kvTransfer.decodeBlocksTtlSeconds"),
        ({"kvTransfer": {"kvBufferDevice": "gpu"}}, "spec.kvTransfer.kvBufferDevice: Input should be 'cuda' or 'cpu'"),
        ({"decode": {"resources": {"limits": {"nvidia.com/gpu": 2}}}}, "spec.decode.resources.limits[nvidia.com/gpu] is derived from tensorParallelSize x dataParallelSize; remove it"),
        ({"model": {"name": "m", "source": {"hf": {}, "pvc": {"claimName": "w"}}}}, "spec.model.source: set only one of hf and pvc"),
        ({"gateway": {"serviceType": "Ingress"}}, "spec.gateway.serviceType: Input should be 'ClusterIP', 'NodePort' or 'LoadBalancer'"),
        ({"decode": {"replica": 2}}, "spec.decode.replica: unknown field; check its spelling"),
        # An unreleased 0.2.0 field: every gateway serves its clients through its data plane.
        ({"gateway": {"dataPlane": False}}, "spec.gateway.dataPlane: unknown field"),
        ({"model": {}}, "spec.model.name: Field required"),
    ],
)  # fmt: skip
def test_invalid_specs_name_the_field_and_the_fix(spec: dict[str, Any], expected: str) -> None:
    found = problems(resource(**spec))
    assert any(p.startswith(expected) for p in found), found


@pytest.mark.parametrize("flag", sorted(PARITY_FLAGS))
@pytest.mark.parametrize("pool", ["prefill", "decode", "render"])
def test_parity_flags_in_extra_args_are_refused_naming_pool_and_flag(pool: str, flag: str) -> None:
    spec: dict[str, Any] = {"prefill": {}}
    spec.setdefault(pool, {})["extraArgs"] = ["--max-logprobs", "5", f"{flag}=x"]
    [problem] = problems(resource(**spec))
    assert problem.startswith(f"spec.{pool}.extraArgs[2] sets parity flag {flag}")
    assert f"set it once in {PARITY_FLAGS[flag]}" in problem


@pytest.mark.parametrize(
    "spelling", ["--tool_call_parser", "--Tool-Call-Parser=hermes", "--no-enable-auto-tool-choice"]
)
def test_parity_flags_are_recognised_in_any_spelling_vllm_accepts(spelling: str) -> None:
    [problem] = problems(resource(decode={"extraArgs": [spelling]}))
    assert "parity flag" in problem


def test_parity_env_is_refused() -> None:
    [name] = PARITY_ENV
    [problem] = problems(resource(decode={"env": [{"name": name, "value": "1"}]}))
    assert problem == (
        f"spec.decode.env[0] sets parity variable {name}: it must be identical in every pool, "
        "so set it once in spec.serving.pythonHashSeed"
    )


def test_flags_the_operator_derives_are_refused_with_the_field_to_use() -> None:
    [problem] = problems(resource(prefill={"extraArgs": ["--tensor-parallel-size", "4"]}))
    assert problem == (
        "spec.prefill.extraArgs[0] sets --tensor-parallel-size, which is derived from "
        "spec.prefill.tensorParallelSize; set it there instead"
    )
    [problem] = problems(resource(decode={"env": [{"name": "UCX_NET_DEVICES", "value": "all"}]}))
    assert "spec.kvTransfer.ucxNetDevices" in problem


def test_ordinary_extra_args_and_env_are_kept() -> None:
    spec = parse_resource(
        resource(decode={"extraArgs": ["--enforce-eager"], "env": [{"name": "X", "value": "1"}]})
    ).spec
    assert spec.decode.extra_args == ["--enforce-eager"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a" * 41, "metadata.name: 'aaaa"),
        ("Qwen", "metadata.name: 'Qwen' must be a DNS label"),
        ("7b-model", "metadata.name: '7b-model' must be a DNS label"),
    ],
)
def test_names_that_cannot_prefix_child_names_are_refused(name: str, expected: str) -> None:
    body = resource()
    body["metadata"]["name"] = name
    assert any(p.startswith(expected) for p in problems(body))


def test_every_problem_is_reported_at_once() -> None:
    found = problems(resource(decode={"replicas": -1}, render={"workers": 0}))
    assert len(found) == 2


def test_a_clique_domain_on_products_that_never_carry_it_is_refused_naming_them() -> None:
    clique = {"topologyKey": "nvidia.com/gpu.clique"}
    [problem] = problems(
        resource(placement={"gpuProducts": ["NVIDIA-H200", "NVIDIA-GB200"], "domain": clique})
    )
    assert problem.startswith(
        "spec.placement: placement.domain.topologyKey nvidia.com/gpu.clique (mode Required) on "
        "NVIDIA-H200: GPU Feature Discovery sets that label only on multi-node NVLink systems"
    )
    assert "Use topologyKey kubernetes.io/hostname" in problem
    h100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    [problem] = problems(resource(placement={"nodeSelector": h100, "domain": {}}))
    assert "on NVIDIA-H100-80GB-HBM3:" in problem
    # GB200 nodes carry it; Preferred may leave the domain; an unknown product is not judged.
    for placement in (
        {"gpuProducts": ["NVIDIA-GB200"], "domain": clique},
        {"gpuProducts": ["NVIDIA-H200"], "domain": {**clique, "mode": "Preferred"}},
        {"gpuProducts": ["NVIDIA-B300-SXM6-AC"], "domain": clique},
        {"domain": clique},
    ):
        parse_resource(resource(placement=placement))
