"""Each cross-field rule is declared once (api/base.py CrossFieldRule) and used twice: as CEL in
the generated CRD and as a Python check. Here both run on a table of cases and must agree:
the same rule broken (or none) for every example, with the API server's defaults applied first
as it does before running CEL."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

import pdserve.api.spec  # noqa: F401  (imports every model)
from pdserve.api.adapters import ONE_ADAPTER_SOURCE, LoraAdapter
from pdserve.api.autoscaling import EngineAutoscalingSpec, RenderAutoscalingSpec, ScalingBehaviour
from pdserve.api.base import CEL, ApiModel, CrossFieldRule, RuleViolation, rules_of
from pdserve.api.crd import build_crd, structural_schema
from pdserve.api.kv_transfer import KvTransferSpec
from pdserve.api.model import ModelCache, ModelSource
from pdserve.api.placement import (
    HOST_NETWORK_SPLITS_A_NODE_DOMAIN,
    ONE_CLAIM_SOURCE,
    PlacementSpec,
    ResourceClaimSpec,
)
from pdserve.api.pools import RANKS_PER_NODE, EnginePoolSpec
from pdserve.api.render import RenderSpec
from pdserve.api.serving import ServingSpec
from pdserve.api.spec import BIDIRECTIONAL_NEEDS_RENDER as BIDIRECTIONAL
from pdserve.api.spec import NIC_PIN_NEEDS_RDMA, TRANSPORTS_NEED_TCP_OR_RDMA, DisaggregatedModelSpec
from tests.support.cel import apply_defaults, evaluate

KEDA = "engine KEDA needs prometheusAddress (the Prometheus its trigger queries)"
MIN_MAX = "maxReplicas must be >= minReplicas"
LOAD_POLICY = "loadFailurePolicy needs a NIXL connector (NixlConnector, NixlPushConnector)"
DECODE_TTL = "decodeBlocksTtlSeconds needs bidirectional: true"
SLICES = "slices > 1 needs a domain (placement.domain.topologyKey) to keep each slice in"
CPU_BLOCK = (
    "blockSize on CPU engines (empty placement.acceleratorResource) must be a multiple of 32 "
    "for vLLM's CPU backend: use 32, 64 or 128, or leave it unset for 128"
)
MODEL = {"model": {"name": "m"}}
CPU = {"placement": {"acceleratorResource": ""}}
TOKENS_ONLY = "engineApi TokensOnly needs enabled: true"
HOST = "kubernetes.io/hostname"
HOST_NETWORK = HOST_NETWORK_SPLITS_A_NODE_DOMAIN.message
NIC_PIN = NIC_PIN_NEEDS_RDMA.message
ONE_CLAIM = ONE_CLAIM_SOURCE.message
NO_TCP = TRANSPORTS_NEED_TCP_OR_RDMA.message
RANKS = RANKS_PER_NODE.message
ONE_ADAPTER = ONE_ADAPTER_SOURCE.message
ADAPTER_HF = {"repo": "org/sql-lora", "revision": "v1"}
RDMA = {"placement": {"rdma": {"resource": "rdma/rdma_shared_device_a"}, "guaranteedQoS": False}}

# (model, object as written, the CEL message of the one rule it breaks, or None)
CASES: list[tuple[type[ApiModel], dict[str, Any], str | None]] = [
    (ModelSource, {}, None),
    (ModelSource, {"hf": {}}, None),
    (ModelSource, {"pvc": {"claimName": "weights"}}, None),
    (ModelSource, {"hf": {}, "pvc": {"claimName": "weights"}}, "set only one of hf and pvc"),
    (LoraAdapter, {"name": "sql", "hf": ADAPTER_HF}, None),
    (LoraAdapter, {"name": "sql", "pvc": {"claimName": "adapters"}}, None),
    (LoraAdapter, {"name": "sql"}, ONE_ADAPTER),
    (LoraAdapter, {"name": "sql", "hf": ADAPTER_HF, "pvc": {"claimName": "a"}}, ONE_ADAPTER),
    (ModelCache, {"claimName": "hf-cache"}, None),
    (ModelCache, {"hostPath": "/var/lib/hf"}, None),
    (ModelCache, {}, "set exactly one of claimName and hostPath"),
    (ModelCache, {"claimName": "c", "hostPath": "/h"}, "set exactly one of claimName and hostPath"),
    (ServingSpec, {}, None),
    (ServingSpec, {"enableAutoToolChoice": False}, None),
    (ServingSpec, {"enableAutoToolChoice": True, "toolCallParser": "hermes"}, None),
    (ServingSpec, {"toolCallParser": "hermes"}, None),
    (ServingSpec, {"enableAutoToolChoice": True}, "enableAutoToolChoice needs toolCallParser"),
    (EnginePoolSpec, {}, None),
    (EnginePoolSpec, {"nodesPerReplica": 1, "dataParallelSize": 3}, None),
    (EnginePoolSpec, {"nodesPerReplica": 2, "dataParallelSize": 4}, None),
    (EnginePoolSpec, {"nodesPerReplica": 4, "dataParallelSize": 16}, None),
    (EnginePoolSpec, {"nodesPerReplica": 2}, RANKS),  # 1 rank per node (the default DP 1)
    (EnginePoolSpec, {"nodesPerReplica": 2, "dataParallelSize": 2}, RANKS),
    (EnginePoolSpec, {"nodesPerReplica": 4, "dataParallelSize": 6}, RANKS),
    (ScalingBehaviour, {}, None),
    (ScalingBehaviour, {"minReplicas": 3, "maxReplicas": 3}, None),
    (ScalingBehaviour, {"minReplicas": 4, "maxReplicas": 2}, MIN_MAX),
    (ScalingBehaviour, {"minReplicas": 5}, MIN_MAX),  # against the default maxReplicas 4
    (ScalingBehaviour, {"maxReplicas": 1}, None),
    (EngineAutoscalingSpec, {"minReplicas": 2, "maxReplicas": 1024}, None),
    (EngineAutoscalingSpec, {"minReplicas": 8, "maxReplicas": 7}, MIN_MAX),
    (EngineAutoscalingSpec, {"minReplicas": 5, "engine": "External"}, MIN_MAX),
    (RenderAutoscalingSpec, {}, None),
    (RenderAutoscalingSpec, {"engine": "HPA"}, None),
    (RenderAutoscalingSpec, {"engine": "Builtin"}, None),
    (RenderAutoscalingSpec, {"engine": "KEDA", "prometheusAddress": "http://prom:9090"}, None),
    (RenderAutoscalingSpec, {"engine": "KEDA"}, KEDA),
    (RenderAutoscalingSpec, {"engine": "KEDA", "minReplicas": 2, "maxReplicas": 2}, KEDA),
    (RenderAutoscalingSpec, {"minReplicas": 9}, MIN_MAX),
    (KvTransferSpec, {}, None),
    (KvTransferSpec, {"loadFailurePolicy": "recompute", "leaseDurationSeconds": 60}, None),
    (KvTransferSpec, {"connector": "NixlPushConnector", "bidirectional": True}, None),
    (KvTransferSpec, {"connector": "MooncakeConnector", "bidirectional": False}, None),
    (KvTransferSpec, {"connector": "LMCacheConnectorV1"}, None),
    (KvTransferSpec, {"connector": "LMCacheConnectorV1", "loadFailurePolicy": "fail"}, LOAD_POLICY),
    (
        KvTransferSpec,
        {"connector": "MooncakeConnector", "leaseDurationSeconds": 5},
        "leaseDurationSeconds needs a NIXL connector",
    ),
    (
        KvTransferSpec,
        {"connector": "MooncakeConnector", "bidirectional": True},
        "bidirectional needs a NIXL connector",
    ),
    (KvTransferSpec, {"bidirectional": True, "decodeBlocksTtlSeconds": 600}, None),
    (KvTransferSpec, {"kvBufferDevice": "cpu", "connector": "MooncakeConnector"}, None),
    (KvTransferSpec, {"decodeBlocksTtlSeconds": 600}, DECODE_TTL),
    (KvTransferSpec, {"bidirectional": False, "decodeBlocksTtlSeconds": 600}, DECODE_TTL),
    (RenderSpec, {}, None),
    (RenderSpec, {"engineApi": "TokensOnly"}, None),
    (RenderSpec, {"enabled": False, "engineApi": "ScaleOut"}, None),
    (RenderSpec, {"enabled": False}, None),
    (RenderSpec, {"enabled": False, "engineApi": "TokensOnly"}, TOKENS_ONLY),
    (PlacementSpec, {}, None),
    (PlacementSpec, {"slices": 1}, None),
    (PlacementSpec, {"slices": 2, "domain": {}}, None),
    (PlacementSpec, {"slices": 4, "domain": {"topologyKey": "kubernetes.io/hostname"}}, None),
    (PlacementSpec, {"slices": 2}, SLICES),
    (ResourceClaimSpec, {"name": "imex", "resourceClaimTemplateName": "cd-channel"}, None),
    (ResourceClaimSpec, {"name": "imex", "resourceClaimName": "shared"}, None),
    (ResourceClaimSpec, {"name": "imex"}, ONE_CLAIM),
    (
        ResourceClaimSpec,
        {"name": "imex", "resourceClaimName": "a", "resourceClaimTemplateName": "b"},
        ONE_CLAIM,
    ),
    (PlacementSpec, {"rdma": {"resource": "rdma/a", "hostNetwork": True}}, None),
    (PlacementSpec, {"rdma": {"resource": "rdma/a", "hostNetwork": True}, "domain": {}}, None),
    (PlacementSpec, {"rdma": {"resource": "rdma/a"}, "domain": {"topologyKey": HOST}}, None),
    (
        PlacementSpec,
        {"rdma": {"resource": "rdma/a", "hostNetwork": True}, "domain": {"topologyKey": HOST}},
        HOST_NETWORK,
    ),
    (DisaggregatedModelSpec, MODEL, None),
    (DisaggregatedModelSpec, {**MODEL, **CPU}, None),  # unset: derived (128)
    (DisaggregatedModelSpec, {**MODEL, "serving": {"blockSize": 16}}, None),
    (DisaggregatedModelSpec, {**MODEL, "serving": {"blockSize": 1}, "placement": {}}, None),
    (
        DisaggregatedModelSpec,
        {**MODEL, "serving": {"blockSize": 8}, "placement": {"acceleratorResource": "amd.com/gpu"}},
        None,
    ),
    (DisaggregatedModelSpec, {**MODEL, **CPU, "serving": {"blockSize": 32}}, None),
    (DisaggregatedModelSpec, {**MODEL, **CPU, "serving": {"blockSize": 64}}, None),
    (DisaggregatedModelSpec, {**MODEL, **CPU, "serving": {"blockSize": 128}}, None),
    (DisaggregatedModelSpec, {**MODEL, **CPU, "serving": {"blockSize": 16}}, CPU_BLOCK),
    (DisaggregatedModelSpec, {**MODEL, **CPU, "serving": {"blockSize": 1}}, CPU_BLOCK),
    (DisaggregatedModelSpec, {**MODEL, **CPU, "serving": {"blockSize": 8}}, CPU_BLOCK),
    (DisaggregatedModelSpec, {**MODEL, "kvTransfer": {"ucxNetDevices": "all"}}, None),
    (DisaggregatedModelSpec, {**MODEL, "kvTransfer": {"bidirectional": True}}, None),
    (
        DisaggregatedModelSpec,
        {**MODEL, "kvTransfer": {"bidirectional": True}, "render": {"enabled": True}},
        None,
    ),
    (
        DisaggregatedModelSpec,
        {**MODEL, "kvTransfer": {"bidirectional": False}, "render": {"enabled": False}},
        None,
    ),
    (
        DisaggregatedModelSpec,
        {**MODEL, "kvTransfer": {"bidirectional": True}, "render": {"enabled": False}},
        BIDIRECTIONAL.message,
    ),
    (DisaggregatedModelSpec, {**MODEL, "kvTransfer": {"ucxNetDevices": "eth0"}}, None),
    (DisaggregatedModelSpec, {**MODEL, "kvTransfer": {"ucxNetDevices": "mlx5_0:1"}}, NIC_PIN),
    (
        DisaggregatedModelSpec,
        {**MODEL, "kvTransfer": {"ucxNetDevices": "mlx5_0:1"}, "placement": {}},
        NIC_PIN,
    ),
    (
        DisaggregatedModelSpec,
        {
            **MODEL,
            "kvTransfer": {"ucxNetDevices": "mlx5_0:1,mlx5_1:1"},
            "placement": {
                "rdma": {"resource": "rdma/rdma_shared_device_a"},
                "guaranteedQoS": False,
            },
        },
        None,
    ),
    (DisaggregatedModelSpec, {**MODEL, "kvTransfer": {"ucxTransports": "tcp"}}, None),
    (DisaggregatedModelSpec, {**MODEL, "kvTransfer": {"ucxTransports": "rc,tcp,cuda_copy"}}, None),
    (DisaggregatedModelSpec, {**MODEL, "kvTransfer": {"ucxTransports": "all"}}, None),
    (DisaggregatedModelSpec, {**MODEL, "kvTransfer": {"ucxTransports": "^rc,ud"}}, None),
    (DisaggregatedModelSpec, {**MODEL, "kvTransfer": {"ucxTransports": "^tcpx"}}, None),
    (
        DisaggregatedModelSpec,
        {**MODEL, "kvTransfer": {"ucxTransports": "rc,cuda_copy,cuda_ipc"}},
        NO_TCP,
    ),
    (DisaggregatedModelSpec, {**MODEL, "kvTransfer": {"ucxTransports": "tcpx,sm"}}, NO_TCP),
    (DisaggregatedModelSpec, {**MODEL, "kvTransfer": {"ucxTransports": "^tcp"}}, NO_TCP),
    (DisaggregatedModelSpec, {**MODEL, "kvTransfer": {"ucxTransports": "^rc,tcp"}}, NO_TCP),
    (DisaggregatedModelSpec, {**MODEL, "kvTransfer": {"ucxTransports": "^tcp,rc"}}, NO_TCP),
    (
        DisaggregatedModelSpec,
        {**MODEL, "kvTransfer": {"ucxTransports": "rc"}, "placement": {}},
        NO_TCP,
    ),
    (
        DisaggregatedModelSpec,
        {**MODEL, "kvTransfer": {"ucxTransports": "rc,cuda_copy"}, **RDMA},
        None,
    ),
    (DisaggregatedModelSpec, {**MODEL, "kvTransfer": {"ucxTransports": "^tcp"}, **RDMA}, None),
]


def cel_broken(model: type[ApiModel], value: dict[str, Any]) -> list[str]:
    """Messages of the CEL rules the generated schema of `model` carries that `value` breaks."""
    schema = structural_schema(model)
    defaulted = apply_defaults(schema, value)
    return [r["message"] for r in schema.get(CEL, []) if evaluate(r["rule"], defaulted) is not True]


def python_broken(model: type[ApiModel], value: dict[str, Any]) -> list[str]:
    """CEL messages of the rules whose Python check refuses `value` (other errors fail)."""
    try:
        model.model_validate(value)
    except ValidationError as error:
        violations = [e.get("ctx", {}).get("error") for e in error.errors()]
    else:
        return []
    assert all(isinstance(v, RuleViolation) for v in violations), violations
    return [v.rule.message for v in violations if isinstance(v, RuleViolation)]


def all_rules() -> dict[str, CrossFieldRule[Any]]:
    models: list[type[ApiModel]] = []
    pending: list[type[ApiModel]] = [ApiModel]
    while pending:
        model = pending.pop()
        models.append(model)
        pending.extend(model.__subclasses__())
    return {r.message: r for model in models for r in rules_of(model)}


@pytest.mark.parametrize(
    ("model", "value", "broken"), CASES, ids=lambda v: v.__name__ if isinstance(v, type) else None
)
def test_cel_and_python_agree(
    model: type[ApiModel], value: dict[str, Any], broken: str | None
) -> None:
    expected = [broken] if broken else []
    assert cel_broken(model, value) == expected
    assert python_broken(model, value) == expected


def test_the_table_breaks_every_rule_and_passes_every_model_with_rules() -> None:
    rules = all_rules()
    assert len(rules) == 19
    assert {broken for _, _, broken in CASES if broken} == set(rules)
    with_rules = {model for model in (c[0] for c in CASES) if rules_of(model)}
    assert with_rules == {model for model, _, broken in CASES if broken is None}


def test_the_crd_carries_each_models_rules_as_declared() -> None:
    """The generated CRD holds exactly the declared rules (and the one on metadata.name)."""

    def walk(node: Any) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        if isinstance(node, dict):
            found += node.get(CEL, [])
            for value in node.values():
                found += walk(value)
        elif isinstance(node, list):
            for value in node:
                found += walk(value)
        return found

    in_crd = {r["message"]: r for r in walk(build_crd())}
    in_crd = {m: r for m, r in in_crd.items() if not m.startswith("metadata.")}
    assert in_crd == {message: r.cel_rule() for message, r in all_rules().items()}


def test_python_errors_keep_their_own_wording() -> None:
    """The Python message names values and the fix; the CEL one is the short form."""
    [problem] = [e["msg"] for e in _errors(RenderAutoscalingSpec, {"minReplicas": 9})]
    assert problem == "Value error, maxReplicas (4) must be >= minReplicas (9)"
    [problem] = [e["msg"] for e in _errors(KvTransferSpec, {"connector": "MooncakeConnector",
                                                           "bidirectional": True})]  # fmt: skip
    assert problem.endswith("bidirectional needs a NIXL connector (NixlConnector, "
                            "NixlPushConnector), not MooncakeConnector")  # fmt: skip


def _errors(model: type[ApiModel], value: dict[str, Any]) -> list[Any]:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(value)
    return list(caught.value.errors())


@pytest.mark.parametrize(
    ("value", "holds"),
    [
        ({}, True),
        ({"serving": {}}, True),
        ({"serving": {"blockSize": 16}}, True),  # no placement: the default, an accelerator
        ({"serving": {"blockSize": 16}, "placement": {}}, True),
        ({"serving": {"blockSize": 16}, "placement": {"acceleratorResource": ""}}, False),
        ({"serving": {"blockSize": 64}, "placement": {"acceleratorResource": ""}}, True),
    ],
)
def test_the_cpu_block_size_rule_guards_fields_the_server_has_not_defaulted(
    value: dict[str, Any], holds: bool
) -> None:
    """Before nested defaults are filled in, the rule sees absent objects; it must not fail on
    them (CEL errors on a missing field), and `%` must be CEL's integer remainder."""
    [cel] = [r for r in rules_of(DisaggregatedModelSpec) if r.field_path == ".serving.blockSize"]
    assert evaluate(cel.cel, value) is holds
    assert evaluate("7 % 32 == 7 && 64 % 32 == 0 && !(48 % 32 == 0)", {}) is True
