"""Parity knobs: the vLLM settings that must be identical in every pool (tokenizer, chat
template, parsers, block size, PYTHONHASHSEED...), each declared once, on its spec field:

    tokenizer: Annotated[Name | None, Parity("--tokenizer")] = None

Everything else is derived from that one declaration (see PARITY_KNOBS in api/spec.py): the
refusal of the flag in a pool's extraArgs/env (api/flags.py), the arguments and environment the
pools get (builders/vllm_args.py, builders/pods.py), the parity hash (builders/parity.py) and the
drift check of live workloads (controller/reconcile.py)."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, JsonValue

if TYPE_CHECKING:
    from pdserve.api.spec import DisaggregatedModelSpec


class Scope(StrEnum):
    """Which pools a parity flag goes to."""

    every_pool = "EveryPool"
    """Every vLLM process: the render pool and every engine (with the model flags)."""
    text = "Text"
    """Where text is handled: the render pool, and every engine that loads a tokenizer (all but
    --tokens-only engines)."""
    engines = "Engines"
    """Every engine (prefill and decode): engine-pair invariants."""


class Render(StrEnum):
    """How a knob's value becomes arguments (an env knob's value is always its string)."""

    value = "Value"
    """`--flag <value>` when set (an enum as its value)."""
    switch = "Switch"
    """`--flag` when true, nothing when false."""
    json = "Json"
    """`--flag <canonical JSON>` when set."""
    json_each = "JsonEach"
    """`--flag <canonical JSON of each item>...` when set (a list; vLLM's nargs=+ flags)."""
    chat_template_file = "ChatTemplateFile"
    """`--flag <the file the builders mount the referenced ConfigMap key at>` when set."""


@dataclass(frozen=True)
class Parity:
    """Field metadata: the field is a parity knob, rendered as vLLM flag `flag` or as the
    environment variable `env` (of every pool). `effective` gives the value the pools get from
    the spec, for a field that derives its default from other fields (block size from the
    engines' backend); default: the field's value. `hashed` gives its value in the parity hash
    from the spec and the chat template's content digest; default: the effective value."""

    flag: str | None = None
    env: str | None = None
    scope: Scope = Scope.text
    render: Render = Render.value
    hashed: Callable[[DisaggregatedModelSpec, str | None], JsonValue] | None = None
    effective: Callable[[DisaggregatedModelSpec], Any] | None = None
    # False: left out of the parity set while its hashed value is None, so a knob added after
    # models were deployed changes none of their hashes (an operator upgrade rolls no pods).
    hashed_when_unset: bool = True

    def __post_init__(self) -> None:
        if (self.flag is None) == (self.env is None):
            raise ValueError("a parity knob is a flag or an environment variable, not both")
        if self.flag is not None and not self.flag.startswith("--"):
            raise ValueError(f"parity flag {self.flag} must be a --long-option")
        if self.env is not None and (self.scope, self.render) != (Scope.every_pool, Render.value):
            raise ValueError(f"parity variable {self.env} goes to every pool, as its value")


@dataclass(frozen=True)
class ParityKnob:
    """One parity knob found on the spec: the field's attribute names from the spec down, their
    JSON names, and its declaration."""

    attributes: tuple[str, ...]
    aliases: tuple[str, ...]
    parity: Parity

    @property
    def path(self) -> str:
        """Where users set it, e.g. spec.serving.tokenizer."""
        return ".".join(("spec", *self.aliases))

    @property
    def key(self) -> str:
        """Its key in the parity set (and hash), e.g. tokenizerRevision."""
        return self.aliases[-1]

    @property
    def flag(self) -> str | None:
        return self.parity.flag

    @property
    def env(self) -> str | None:
        return self.parity.env

    def value(self, spec: DisaggregatedModelSpec) -> Any:
        """The value the pools get: the field's value in `spec` (None when a model on the way is
        unset), or what `effective` derives. Arguments, environment and hash all use it, so a
        field left unset and one set to what it derives to build and hash the same."""
        if self.parity.effective is not None:
            return self.parity.effective(spec)
        value: Any = spec
        for attribute in self.attributes:
            if value is None:
                return None
            value = getattr(value, attribute)
        return value

    def hashed(self, spec: DisaggregatedModelSpec, chat_template_digest: str | None) -> JsonValue:
        """Its value in the parity set: the effective value, unless `hashed` says otherwise."""
        if self.parity.hashed is not None:
            return self.parity.hashed(spec, chat_template_digest)
        value = self.value(spec)
        if isinstance(value, Enum):
            return typing.cast(JsonValue, value.value)
        if isinstance(value, BaseModel):
            return typing.cast(JsonValue, value.model_dump(by_alias=True, mode="json"))
        return typing.cast(JsonValue, value)


def hashed_knobs(
    knobs: tuple[ParityKnob, ...],
    spec: DisaggregatedModelSpec,
    chat_template_digest: str | None,
    scope: Scope | None = None,
) -> dict[str, JsonValue]:
    """The knobs' entries in a parity set (those of `scope` only, when given), by key."""
    entries: dict[str, JsonValue] = {}
    for knob in knobs:
        if scope is not None and knob.parity.scope is not scope:
            continue
        value = knob.hashed(spec, chat_template_digest)
        if value is not None or knob.parity.hashed_when_unset:
            entries[knob.key] = value
    return entries


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models a field holds directly (X, X | None, Annotated[X, ...]); not in lists or maps."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in models_in(arg)]
    return []


def parity_knobs(
    model: type[BaseModel], attributes: tuple[str, ...] = (), aliases: tuple[str, ...] = ()
) -> tuple[ParityKnob, ...]:
    """Every field marked Parity in `model` and the models under it, in declaration order."""
    found: list[ParityKnob] = []
    for name, field in model.model_fields.items():
        here, alias = (*attributes, name), (*aliases, field.alias or name)
        for marker in field.metadata:
            if isinstance(marker, Parity):
                found.append(ParityKnob(here, alias, marker))
        for sub_model in models_in(field.annotation):
            found.extend(parity_knobs(sub_model, here, alias))
    return tuple(found)
