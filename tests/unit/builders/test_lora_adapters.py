"""spec.model.adapters from the spec to the pods: the engines' LoRA flags, every adapter at one
path in every engine pod (mounted from its claim or downloaded at its revision first), render
taking the adapters' names, the gateway told them, the parity set holding them, and the spec
refused with the field named where vLLM would refuse to start."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.api import DisaggregatedModel, SpecError, parse_resource
from pdserve.builders import build_all, parity_hash, routing_config
from pdserve.builders.adapters import DOWNLOAD_RESOURCES, DOWNLOADS_MOUNT

SQL: dict[str, Any] = {
    "name": "sql",
    "hf": {"repo": "org/sql-lora", "revision": "0123abcd"},
    "rank": 32,
}
SUPPORT: dict[str, Any] = {
    "name": "support",
    "pvc": {"claimName": "adapters", "path": "support/v2"},
}


def model(
    adapters: list[dict[str, Any]] | None = None,
    source: dict[str, Any] | None = None,
    **spec: Any,
) -> DisaggregatedModel:
    body: dict[str, Any] = {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "DisaggregatedModel",
        "metadata": {"name": "qwen", "namespace": "llm"},
        "spec": {"model": {"name": "Qwen/Qwen3-8B"}, "prefill": {"replicas": 1}, **spec},
    }
    if adapters is not None:
        body["spec"]["model"]["adapters"] = adapters
    if source is not None:
        body["spec"]["model"]["source"] = source
    return parse_resource(body)


def pod_spec(dm: DisaggregatedModel, component: str) -> dict[str, Any]:
    workloads = ("StatefulSet", "Deployment")
    [workload] = [
        o for o in build_all(dm)
        if o["kind"] in workloads and o["metadata"]["name"] == f"qwen-{component}"
    ]  # fmt: skip
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def test_engines_serve_every_adapter_from_one_path_with_loras_capacity() -> None:
    dm = model([SQL, SUPPORT])
    for pool in ("prefill", "decode"):
        [vllm] = pod_spec(dm, pool)["containers"]
        args = vllm["args"]
        modules = args[args.index("--lora-modules") + 1 : args.index("--lora-modules") + 3]
        assert [json.loads(m) for m in modules] == [
            {"name": "sql", "path": "/pdserve/adapters/sql"},
            {"name": "support", "path": "/pdserve/adapters/support"},
        ]
        assert "--enable-lora" in args
        # rank 32 declared: the smallest of vLLM's choices that holds it; 2 adapters, 2 slots.
        flags = {f: args[args.index(f) + 1] for f in
                 ("--max-lora-rank", "--max-loras", "--max-cpu-loras")}  # fmt: skip
        assert flags == {"--max-lora-rank": "32", "--max-loras": "2", "--max-cpu-loras": "2"}
        mounts = {m["mountPath"]: m for m in vllm["volumeMounts"]}
        assert mounts["/pdserve/adapters/sql"]["subPath"] == "sql"
        assert mounts["/pdserve/adapters/support"]["subPath"] == "support/v2"
        assert all(
            mounts[p]["readOnly"] for p in ("/pdserve/adapters/sql", "/pdserve/adapters/support")
        )


def test_hub_adapters_are_downloaded_at_their_revision_before_the_engine_starts() -> None:
    spec = pod_spec(model([SQL, SUPPORT]), "decode")
    [init] = spec["initContainers"]
    assert init["command"][-4:] == [DOWNLOADS_MOUNT, "org/sql-lora", "0123abcd", "sql"]
    assert init["image"] == spec["containers"][0]["image"]
    # requests == limits: a pod asked to be Guaranteed stays so.
    assert init["resources"] == {"requests": DOWNLOAD_RESOURCES, "limits": DOWNLOAD_RESOURCES}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["lora-claim-adapters"]["persistentVolumeClaim"] == {
        "claimName": "adapters", "readOnly": True,
    }  # fmt: skip
    assert "emptyDir" in volumes["lora-downloads"]
    # Only claims: nothing to download.
    assert "initContainers" not in pod_spec(model([SUPPORT]), "decode")


def test_a_model_from_a_claim_still_downloads_its_hub_adapters() -> None:
    spec = pod_spec(model([SQL], source={"pvc": {"claimName": "weights"}}), "decode")
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in spec["containers"][0]["env"]
    assert all(v["name"] != "HF_HUB_OFFLINE" for v in spec["initContainers"][0]["env"])


def test_render_takes_the_adapters_names_and_gets_no_lora_flags() -> None:
    [render] = pod_spec(model([SUPPORT]), "render")["containers"]
    assert {"name": "VLLM_SKIP_MODEL_NAME_VALIDATION", "value": "1"} in render["env"]
    assert not [a for a in render["args"] if "lora" in a]
    [plain] = pod_spec(model(), "render")["containers"]
    assert all(e["name"] != "VLLM_SKIP_MODEL_NAME_VALIDATION" for e in plain["env"])


def test_the_gateway_is_told_the_adapters() -> None:
    dm = model([SQL, SUPPORT])
    config = routing_config(dm, parity_hash(dm))
    assert (config.adapters, config.schema_version) == (["sql", "support"], 4)
    assert routing_config(model(), parity_hash(model())).schema_version == 3


def test_adapters_are_part_of_the_parity_set_and_none_changes_no_hash() -> None:
    without = parity_hash(model())
    assert parity_hash(model([])) == without
    first, moved = model([SUPPORT]), model([{**SUPPORT, "pvc": {"claimName": "adapters"}}])
    assert len({without, parity_hash(first), parity_hash(moved)}) == 3
    newer = model([{**SQL, "hf": {**SQL["hf"], "revision": "4567"}}])
    assert parity_hash(newer) != parity_hash(model([SQL]))


@pytest.mark.parametrize(
    ("adapters", "spec", "problem"),
    [
        ([{**SQL, "rank": 64}], {"lora": {"maxRank": 32}}, "spec.model.adapters[0].rank 64 is "
         "above spec.model.lora.maxRank 32"),
        ([{**SQL, "rank": 64}], {"lora": {"maxRank": 32}}, "raise maxRank to one of 64, 128"),
        ([SUPPORT, SQL], {"lora": {"maxLoras": 4, "maxCpuLoras": 2}},
         "spec.model.lora.maxCpuLoras 2 is below maxLoras 4"),
        ([], {"lora": {"maxRank": 64}}, "spec.model.lora is set but spec.model.adapters is empty"),
        ([SUPPORT, {**SQL, "name": "support"}], {}, "spec.model.adapters[1].name 'support' is "
         "declared twice"),
        ([{**SUPPORT, "name": "qwen"}], {}, "spec.model.adapters[0].name 'qwen' is the served "
         "model's name"),
        ([{"name": "sql"}], {}, "set exactly one of hf and pvc"),
        ([{**SQL, "name": "org/sql"}], {}, "spec.model.adapters[0].name: String should match"),
        ([{"name": "sql", "hf": {"repo": "org/sql-lora"}}], {}, "revision"),
    ],
)  # fmt: skip
def test_what_vllm_would_refuse_at_start_is_refused_naming_the_field(
    adapters: list[dict[str, Any]], spec: dict[str, Any], problem: str
) -> None:
    body_model = {"name": "Qwen/Qwen3-8B", "adapters": adapters, **spec}
    with pytest.raises(SpecError) as caught:
        parse_resource({
            "apiVersion": "pdserve.io/v1alpha1", "kind": "DisaggregatedModel",
            "metadata": {"name": "qwen", "namespace": "llm"}, "spec": {"model": body_model},
        })  # fmt: skip
    assert problem in str(caught.value)


@pytest.mark.parametrize(
    ("flag", "field"),
    [("--enable-lora", "spec.model.adapters"), ("--max-loras=2", "spec.model.lora.maxLoras"),
     ("--lora-modules", "spec.model.adapters")],
)  # fmt: skip
def test_lora_flags_in_extra_args_are_refused_naming_the_field(flag: str, field: str) -> None:
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        model(decode={"extraArgs": [flag]})
