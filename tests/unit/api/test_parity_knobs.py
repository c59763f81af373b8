"""A parity knob is declared once, on its spec field (api/parity.py Parity), and everything else
follows from that declaration: iterating the declarations, each knob is refused in every pool's
extraArgs (or env), emitted into the pools its scope names, part of the parity hash, and
compared on live workloads by the drift check. Sample values come from each field's type (or the
examples it declares), so a new knob needs no edit here."""

from __future__ import annotations

import copy
import typing
from enum import Enum
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pdserve.api import (
    PARITY_ENV,
    PARITY_FLAGS,
    PARITY_KNOBS,
    DisaggregatedModel,
    SpecError,
    parse_resource,
)
from pdserve.api.flags import OWNED_ENV, OWNED_FLAGS, normalize_flag
from pdserve.api.parity import ParityKnob, Render, Scope, models_in
from pdserve.api.spec import DisaggregatedModelSpec
from pdserve.builders import build_all
from pdserve.builders.parity import parity_hash, parity_set
from pdserve.controller.children import key_of
from pdserve.controller.drift import parity_drift

IDS = [k.path for k in PARITY_KNOBS]


def field_of(knob: ParityKnob) -> FieldInfo:
    model: type[BaseModel] = DisaggregatedModelSpec
    for attribute in knob.attributes[:-1]:
        [model] = models_in(model.model_fields[attribute].annotation)
    return model.model_fields[knob.attributes[-1]]


def samples(knob: ParityKnob) -> list[Any]:
    """Two JSON values of the knob's field, the first never its default: its declared examples,
    else made from its type."""
    field = field_of(knob)
    if field.examples:
        return list(field.examples[:2])
    kind: Any = field.annotation
    if typing.get_origin(kind) in (typing.Union, type(int | None)):
        [kind] = [a for a in typing.get_args(kind) if a is not type(None)]
    while typing.get_origin(kind) is typing.Annotated:
        kind = typing.get_args(kind)[0]
    default = field.default
    if kind is bool:
        return [not default, bool(default)]
    if typing.get_origin(kind) is typing.Literal:
        return [v for v in typing.get_args(kind) if v != default][:2]
    if isinstance(kind, type) and issubclass(kind, Enum):
        return [m.value for m in kind if m != default][:2]
    if kind is int:
        return [(default or 0) + 1, (default or 0) + 2]
    if kind is str:
        return ["x0", "x1"]
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        required = [f.alias or n for n, f in kind.model_fields.items() if f.is_required()]
        return [{name: f"v{i}" for name in required} for i in range(2)]
    if typing.get_origin(kind) is dict:
        return [{"k": 0}, {"k": 1}]
    raise AssertionError(f"no samples for {knob.path}: {kind}")


def body(overrides: dict[ParityKnob, Any], **spec: Any) -> dict[str, Any]:
    """A resource with every knob at its first sample, `overrides` replacing some."""
    values = {knob: samples(knob)[0] for knob in PARITY_KNOBS} | overrides
    full: dict[str, Any] = {"model": {"name": "org/model"}, "prefill": {}, **spec}
    for knob, value in values.items():
        node = full
        for alias in knob.aliases[:-1]:
            node = node.setdefault(alias, {})
        node[knob.aliases[-1]] = value
    return {"apiVersion": "pdserve.io/v1alpha1", "kind": "DisaggregatedModel",
            "metadata": {"name": "m", "namespace": "ns"}, "spec": full}  # fmt: skip


def model(overrides: dict[ParityKnob, Any] | None = None, **spec: Any) -> DisaggregatedModel:
    return parse_resource(body(overrides or {}, **spec))


def workloads(dm: DisaggregatedModel) -> dict[str, dict[str, Any]]:
    """The vLLM containers by pool: prefill, decode, render."""
    return {
        obj["metadata"]["name"].removeprefix("m-"): obj["spec"]["template"]["spec"]["containers"][0]
        for obj in build_all(dm)
        if is_vllm_workload(obj)
    }


def is_vllm_workload(obj: dict[str, Any]) -> bool:
    return obj["kind"] in ("StatefulSet", "Deployment") and "gateway" not in obj["metadata"]["name"]


def test_the_declarations_are_complete_and_distinct() -> None:
    assert len(PARITY_KNOBS) == len(PARITY_FLAGS) + len(PARITY_ENV)
    keys = [k.key for k in PARITY_KNOBS]
    assert len(set(keys)) == len(keys)
    assert not {"model", "kvConnector"} & set(keys)  # the hash's own entries
    assert not set(PARITY_FLAGS) & set(OWNED_FLAGS)
    assert not set(PARITY_ENV) & set(OWNED_ENV)
    assert all(normalize_flag(flag) == flag for flag in PARITY_FLAGS)
    assert model().spec.serving.enable_auto_tool_choice  # every knob's first sample is valid


@pytest.mark.parametrize("knob", PARITY_KNOBS, ids=IDS)
@pytest.mark.parametrize("pool", ["prefill", "decode", "render"])
def test_refused_in_every_pools_extra_args_or_env(knob: ParityKnob, pool: str) -> None:
    spec: dict[str, Any] = {"model": {"name": "m"}, "prefill": {}}
    if knob.flag is not None:
        spec[pool] = {"extraArgs": [f"{knob.flag}=x"]}
        expected = f"spec.{pool}.extraArgs[0] sets parity flag {knob.flag}"
    else:
        spec[pool] = {"env": [{"name": knob.env, "value": "1"}]}
        expected = f"spec.{pool}.env[0] sets parity variable {knob.env}"
    with pytest.raises(SpecError) as caught:
        parse_resource(body({}) | {"spec": spec})
    [problem] = caught.value.problems
    assert problem.startswith(expected)
    assert problem.endswith(f"set it once in {knob.path}")


@pytest.mark.parametrize("knob", PARITY_KNOBS, ids=IDS)
@pytest.mark.parametrize("engine_api", ["ScaleOut", "TokensOnly", None], ids=str)
def test_emitted_into_the_pools_its_scope_names(knob: ParityKnob, engine_api: str | None) -> None:
    """None: no render pool. Text flags go to every pool that loads a tokenizer: all but
    --tokens-only engines."""
    render = engine_api is not None
    spec = {"enabled": True, "engineApi": engine_api} if render else {"enabled": False}
    pools = workloads(model(render=spec))
    assert set(pools) == {"prefill", "decode", *(["render"] if render else [])}
    for pool, container in pools.items():
        if knob.env is not None:
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env[knob.env] == str(samples(knob)[0]), pool
            continue
        flags = [normalize_flag(a) for a in container["args"]]
        scope = knob.parity.scope
        wanted = (
            scope is Scope.every_pool
            or (scope is Scope.engines and pool != "render")
            or (scope is Scope.text and (pool == "render" or engine_api != "TokensOnly"))
        )
        assert flags.count(knob.flag) == (1 if wanted else 0), (pool, container["args"])
        if wanted and knob.parity.render is not Render.switch:
            value = container["args"][container["args"].index(knob.flag) + 1]
            assert not value.startswith("--"), (pool, value)


@pytest.mark.parametrize("knob", PARITY_KNOBS, ids=IDS)
def test_part_of_the_parity_hash(knob: ParityKnob) -> None:
    first, second = model(), model({knob: samples(knob)[1]})
    assert parity_set(first)[knob.key] != parity_set(second)[knob.key]
    assert parity_hash(first) != parity_hash(second)


@pytest.mark.parametrize("knob", PARITY_KNOBS, ids=IDS)
def test_compared_on_live_workloads_by_the_drift_check(knob: ParityKnob) -> None:
    """A live workload edited by hand (its parity hash annotation left as it was) is drift."""
    want = build_all(model())
    live = {key_of(o): copy.deepcopy(o) for o in want}
    assert parity_drift(want, live) == []
    edited = []
    for obj in live.values():
        if not is_vllm_workload(obj):
            continue
        container = obj["spec"]["template"]["spec"]["containers"][0]
        if knob.env is not None:
            for var in container["env"]:
                if var["name"] == knob.env:
                    var["value"] = "edited"
                    edited.append(obj["metadata"]["name"])
        elif knob.flag in container["args"]:
            index = container["args"].index(knob.flag)
            width = 1 if knob.parity.render is Render.switch else 2
            del container["args"][index : index + width]
            edited.append(obj["metadata"]["name"])
    assert edited
    name = knob.flag or knob.env
    found = parity_drift(want, live)
    assert len(found) == len(edited), found
    for workload, message in zip(sorted(edited), sorted(found), strict=True):
        assert f"/{workload}: {name} is " in message
