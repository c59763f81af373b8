"""The KV-compatibility digest (pdserve.io/kv-compat): equal on prefill and decode of one spec
when their KV inputs match, different as soon as any input NIXL compares differs, and the same
value in the routing config the gateway reads."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.api import DisaggregatedModel
from pdserve.builders import build_all, routing_config
from pdserve.contract.names import KV_COMPAT_ANNOTATION
from tests.support.specs import spec_with

BASE: dict[str, Any] = {
    "metadata": {"name": "m", "namespace": "ns"},
    "spec": {"model": {"name": "org/model"}, "prefill": {}, "decode": {}},
}


def model(**changes: Any) -> DisaggregatedModel:
    return spec_with(BASE, **changes)


def digests(dm: DisaggregatedModel) -> dict[str, str | None]:
    """Component -> the digest on its StatefulSets' pod templates (one value per component)."""
    found: dict[str, set[str | None]] = {}
    for obj in build_all(dm):
        if obj["kind"] == "StatefulSet":
            component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
            annotations = obj["spec"]["template"]["metadata"]["annotations"]
            found.setdefault(component, set()).add(annotations.get(KV_COMPAT_ANNOTATION))
    assert all(len(values) == 1 for values in found.values()), found
    return {component: values.pop() for component, values in found.items()}


def test_prefill_and_decode_with_equal_inputs_get_one_digest() -> None:
    d = digests(model())
    assert d["prefill"] is not None
    assert d["prefill"] == d["decode"]
    pools = routing_config(model(), "p").pools
    assert pools.prefill is not None
    assert (pools.prefill.kv_compat, pools.decode.kv_compat) == (d["prefill"], d["decode"])


@pytest.mark.parametrize(
    "change",
    [
        # Inputs that legitimately differ between the roles.
        {"prefill__replicas": 3},
        {"decode__resources": {"requests": {"cpu": "4"}}},
        {"decode__gpuMemoryUtilization": 0.8},
        {"prefill__scheduler": {"maxNumBatchedTokens": 8192}},
        {"decode__extraArgs": ["--enforce-eager"]},
        {"prefill__podAnnotations": {"team": "a"}},
        {"decode__env": [{"name": "NCCL_DEBUG", "value": "INFO"}]},
        # A declared heterogeneous-TP pair still pairs.
        {"prefill__tensorParallelSize": 2},
    ],
    ids=lambda c: next(iter(c)),
)
def test_what_may_differ_between_the_roles_keeps_them_paired(change: dict[str, Any]) -> None:
    d = digests(model(**change))
    assert d["prefill"] == d["decode"]


@pytest.mark.parametrize(
    "change",
    [
        {"prefill__extraArgs": ["--dtype", "float16"]},
        {"decode__extraArgs": ["--dtype=bfloat16"]},
        {"decode__extraArgs": ["--Attention_Backend", "FLASHINFER"]},
        {"prefill__extraArgs": ["--quantization", "fp8"]},
        {"decode__extraArgs": ["--pipeline-parallel-size", "2"]},
        {"decode__env": [{"name": "VLLM_KV_CACHE_LAYOUT", "value": "HND"}]},
    ],
    ids=lambda c: str(next(iter(c.values()))),
)
def test_a_kv_layout_input_of_one_pool_separates_the_roles(change: dict[str, Any]) -> None:
    d = digests(model(**change))
    assert d["prefill"] != d["decode"]
    assert {d["prefill"], d["decode"]} & set(digests(model()).values())  # one side unchanged


@pytest.mark.parametrize(
    "change",
    [
        {"image__engine": "vllm/vllm-openai:v0.34.0"},
        {"image__engine": "vllm/vllm-openai@sha256:" + "a" * 64},
        {"model__revision": "v2"},
        {"model__name": "org/other"},
        {"serving__blockSize": 32},
        {"serving__kvCacheDtype": "fp8"},
        {"kvTransfer__kvBufferDevice": "cpu"},
        {"kvTransfer__connector": "NixlPushConnector"},
        {"kvTransfer__bidirectional": True},
        {"placement__acceleratorResource": ""},
        {"prefill__tensorParallelSize": 2},
        {"decode__tensorParallelSize": 4},
    ],
    ids=lambda c: f"{next(iter(c))}={next(iter(c.values()))}",
)
def test_a_new_spec_gives_pods_that_never_pair_with_the_old_ones(change: dict[str, Any]) -> None:
    """An upgrade (a new image, TP size, ...) rolls prefill and decode separately: the new pods'
    digest differs from the old pods' on both sides."""
    old, new = digests(model()), digests(model(**change))
    assert new["prefill"] == new["decode"]
    assert new["prefill"] != old["prefill"]


def test_aggregated_engines_carry_no_digest() -> None:
    dm = model(prefill__replicas=0)
    assert digests(dm) == {"decode": None}
    assert routing_config(dm, "p").pools.decode.kv_compat is None
