"""How engine, render and gateway pods live and die: vLLM's drain on SIGTERM within the grace
period, probe timeouts, default CPU/memory of GPU engines (BestEffort never), one NIXL port per
data-parallel rank, a capped /dev/shm, and the gateway's request timeout."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pdserve.api import DisaggregatedModel, SpecError, parse_resource
from pdserve.builders import build_all


def model(**spec: Any) -> DisaggregatedModel:
    body: dict[str, Any] = {
        "apiVersion": "pdserve.io/v1alpha1",
        "kind": "DisaggregatedModel",
        "metadata": {"name": "qwen", "namespace": "llm"},
        "spec": {"model": {"name": "Qwen/Qwen3-8B"}, "prefill": {"replicas": 1}},
    }
    body["spec"].update(copy.deepcopy(spec))
    return parse_resource(body)


def problems(**spec: Any) -> str:
    with pytest.raises(SpecError) as caught:
        model(**spec)
    return "; ".join(caught.value.problems)


def objects(dm: DisaggregatedModel) -> dict[str, Any]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in build_all(dm)}


def pod(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def container(obj: dict[str, Any]) -> dict[str, Any]:
    first: dict[str, Any] = pod(obj)["containers"][0]
    return first


def flag(obj: dict[str, Any], name: str) -> str:
    args: list[str] = container(obj)["args"]
    return args[args.index(name) + 1]


# --- probes ----------------------------------------------------------------------------------


def test_every_probe_has_an_explicit_timeout() -> None:
    built = objects(model())
    for name in ("StatefulSet/qwen-prefill", "StatefulSet/qwen-decode",
                 "Deployment/qwen-render", "Deployment/qwen-gateway"):  # fmt: skip
        probes = {k: v for k, v in container(built[name]).items() if k.endswith("Probe")}
        assert probes["readinessProbe"]["timeoutSeconds"] == 2, name
        assert probes["livenessProbe"]["timeoutSeconds"] == 5, name
        if "startupProbe" in probes:
            assert probes["startupProbe"]["timeoutSeconds"] == 5, name
