"""The whole `DisaggregatedModel` object and parsing it at the boundary."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, ValidationError, model_validator

from pdserve.api.adapters import served_name_clash
from pdserve.api.base import ApiModel
from pdserve.api.spec import DisaggregatedModelSpec
from pdserve.api.status import DisaggregatedModelStatus
from pdserve.contract.resource import API_VERSION, KIND
from pdserve.validation import format_validation_error, without_unknown_fields

# Child names are "<name>-prefill", "<name>-decode", "<name>-render", "<name>-gateway" (and
# "-s<n>" slices later). A StatefulSet's pods carry the label controller-revision-hash =
# "<statefulset>-<10 chars>", which must fit in 63 characters; 40 leaves room for every suffix.
MAX_NAME_LENGTH = 40
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class ObjectMeta(ApiModel):
    """The parts of metadata pdserve reads."""

    model_config = ApiModel.model_config | {"extra": "ignore"}

    name: Annotated[str, Field(min_length=1)]
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class DisaggregatedModel(ApiModel):
    """A parsed, validated DisaggregatedModel."""

    model_config = ApiModel.model_config | {"extra": "ignore"}

    api_version: str = API_VERSION
    kind: str = KIND
    metadata: ObjectMeta
    spec: DisaggregatedModelSpec
    status: DisaggregatedModelStatus | None = None

    @model_validator(mode="after")
    def _adapters_not_named_as_the_model(self) -> DisaggregatedModel:
        if problems := served_name_clash(self.spec.model.adapters, self.served_model_name):
            raise ValueError("; ".join(problems))
        return self

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace

    @property
    def served_model_name(self) -> str:
        return self.spec.model.served_model_name or self.metadata.name


class SpecError(ValueError):
    """An invalid DisaggregatedModel; `problems` name each field and the fix."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def check_name(name: str) -> list[str]:
    problems = []
    if len(name) > MAX_NAME_LENGTH:
        problems.append(
            f"metadata.name: {name!r} is {len(name)} characters; at most {MAX_NAME_LENGTH} fit "
            "the child names (<name>-prefill, <name>-gateway, ...)"
        )
    if not DNS_LABEL.match(name):
        problems.append(
            f"metadata.name: {name!r} must be a DNS label (lowercase letters, digits and '-', "
            "starting with a letter), because it names Services"
        )
    return problems


def parse_spec(spec: Any) -> DisaggregatedModelSpec:
    """Validate a raw spec (as the API server stores it); SpecError names every problem."""
    try:
        return DisaggregatedModelSpec.model_validate(spec)
    except ValidationError as error:
        raise SpecError(format_validation_error(error, "spec")) from None


def parse_resource(body: Any) -> DisaggregatedModel:
    """Validate a whole object (metadata + spec); SpecError names every problem."""
    if not isinstance(body, dict):
        raise SpecError(["the object must be a mapping with metadata and spec"])
    problems = check_name(str(body.get("metadata", {}).get("name", "")))
    try:
        resource = DisaggregatedModel.model_validate(body)
    except ValidationError as error:
        problems += format_validation_error(error)
        raise SpecError(problems) from None
    if problems:
        raise SpecError(problems)
    return resource


NEWER_FIELD = (
    "not known to this operator version, ignored: the CRD is newer than the operator "
    "(mid upgrade, or after a rollback); upgrade the operator to use it"
)


def parse_stored(body: Any) -> tuple[DisaggregatedModel, list[str]]:
    """An object as the API server stores it (the webhook's and the reconciler's input), and a
    warning per field this operator does not know, left out instead of refused: the API server
    has already refused or pruned what its CRD lacks, so such a field comes from a newer CRD
    (often a default it filled in), and refusing it would refuse every apply and fail every
    model until the operator catches up. Files parsed offline (`pdserve manifests`) go through
    parse_resource, which refuses them (a typo there has no CRD to catch it)."""
    if not isinstance(body, dict):
        return parse_resource(body), []
    known, unknown = without_unknown_fields(DisaggregatedModel, body)
    return parse_resource(known), [f"{path}: {NEWER_FIELD}" for path in unknown]
