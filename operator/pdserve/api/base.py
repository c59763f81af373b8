"""The base every API model shares: camelCase JSON, unknown fields rejected, attribute
docstrings as field descriptions (they become the CRD's `kubectl explain` text)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict, JsonValue

# x-kubernetes-* keys are carried through JSON schema generation under this extra key.
CEL = "x-kubernetes-validations"


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


# CEL rules guard every field with has(): the API server checks them against the schema
# defaults ({}) before nested defaults are filled in.
def rule(expression: str, message: str, field_path: str | None = None) -> JsonDict:
    """One CEL rule for `x-kubernetes-validations`."""
    out: JsonDict = {"rule": expression, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


def with_rules(rules: list[JsonDict]) -> ConfigDict:
    """ApiModel's config plus CEL rules that the generated CRD carries on this object."""
    extra: JsonDict = {CEL: list[JsonValue](rules)}
    return ConfigDict(**{**ApiModel.model_config, "json_schema_extra": extra})
