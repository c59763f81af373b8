"""The base every API model shares: camelCase JSON, unknown fields rejected, attribute
docstrings as field descriptions (they become the CRD's `kubectl explain` text), and
cross-field rules declared once for both the CRD (CEL) and Python validation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Self, TypeVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict, JsonValue

# x-kubernetes-* keys are carried through JSON schema generation under this extra key.
CEL = "x-kubernetes-validations"

M = TypeVar("M", bound=BaseModel)


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )

    def to_json(self) -> dict[str, Any]:
        """The camelCase JSON form, without unset optional fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Self:
        for cross_field_rule in rules_of(type(self)):
            cross_field_rule.validate(self)
        return self


# CEL rules guard every field with has(): the API server checks them against the schema
# defaults ({}) before nested defaults are filled in.
def rule(expression: str, message: str, field_path: str | None = None) -> JsonDict:
    """One CEL rule for `x-kubernetes-validations`."""
    out: JsonDict = {"rule": expression, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


class RuleViolation(ValueError):
    """A cross-field rule's Python check failed; `rule` says which (pydantic keeps the
    exception in the error's ctx)."""

    def __init__(self, violated: CrossFieldRule[Any], message: str) -> None:
        super().__init__(message)
        self.rule = violated


@dataclass(frozen=True)
class CrossFieldRule(Generic[M]):
    """One rule over several fields of one object, declared once: `cel` (with `message` and
    `field_path`) is what the generated CRD carries for the API server, `check` is the same
    condition in Python, returning the error to report (with the values and the fix) or None."""

    cel: str
    message: str
    field_path: str | None
    check: Callable[[M], str | None]

    def cel_rule(self) -> JsonDict:
        return rule(self.cel, self.message, self.field_path)

    def validate(self, model: M) -> None:
        error = self.check(model)
        if error is not None:
            raise RuleViolation(self, error)


class _CelRules:
    """A model's json_schema_extra: its cross-field rules, written as CEL into its schema."""

    def __init__(self, rules: Sequence[CrossFieldRule[Any]]) -> None:
        self.rules = tuple(rules)

    def __call__(self, schema: JsonDict) -> None:
        schema[CEL] = list[JsonValue](r.cel_rule() for r in self.rules)


def with_rules(rules: Sequence[CrossFieldRule[Any]]) -> ConfigDict:
    """ApiModel's config plus cross-field rules: the generated CRD carries their CEL on this
    object and ApiModel's validator checks them in Python, in this order. A subclass inherits
    them; one that declares its own replaces the list (so it repeats the parent's)."""
    return ConfigDict(**{**ApiModel.model_config, "json_schema_extra": _CelRules(rules)})


def rules_of(model: type[BaseModel]) -> tuple[CrossFieldRule[Any], ...]:
    """The cross-field rules declared with `with_rules` on `model` (or inherited)."""
    extra = model.model_config.get("json_schema_extra")
    return extra.rules if isinstance(extra, _CelRules) else ()
