"""Types every part of the spec shares: Kubernetes quantities, free-form objects, label maps,
references to Secret and ConfigMap keys, environment variables."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, JsonValue

from pdserve.api.base import ApiModel

# Quantities stay strings or numbers exactly as Kubernetes accepts them ("500m", 2, "16Gi").
Quantity = Annotated[
    str | int,
    Field(json_schema_extra={"x-kubernetes-int-or-string": True}),
]
PreservedObject = Annotated[
    dict[str, JsonValue],
    Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}),
]
LabelMap = dict[str, str]


class SecretKeyRef(ApiModel):
    """A key in a Secret of the resource's namespace."""

    name: Annotated[str, Field(min_length=1, max_length=253)]
    """Name of the Secret."""
    key: Annotated[str, Field(min_length=1)]
    """Key inside the Secret."""


class ConfigMapKeyRef(ApiModel):
    """A key in a ConfigMap of the resource's namespace."""

    name: Annotated[str, Field(min_length=1, max_length=253)]
    """Name of the ConfigMap."""
    key: Annotated[str, Field(min_length=1)]
    """Key inside the ConfigMap."""


class EnvVar(ApiModel):
    """An environment variable, as in a container's env."""

    name: Annotated[str, Field(min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")]
    """Variable name."""
    value: str | None = None
    """Literal value."""
    value_from: PreservedObject | None = None
    """Source of the value (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef)."""
