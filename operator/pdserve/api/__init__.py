"""pdserve's API: pydantic models of the DisaggregatedModel custom resource, the one source of
validation, defaults, documentation and the generated CRD."""

from __future__ import annotations

from pdserve.api.gateway import RoutingMode
from pdserve.api.kv_transfer import KvConnector
from pdserve.api.pools import EnginePoolSpec
from pdserve.api.resource import (
    DisaggregatedModel,
    SpecError,
    parse_resource,
    parse_spec,
    parse_stored,
)
from pdserve.api.spec import PARITY_ENV, PARITY_FLAGS, PARITY_KNOBS, DisaggregatedModelSpec
from pdserve.api.status import Condition, ConditionType, DisaggregatedModelStatus, Phase
from pdserve.contract.resource import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
)
from pdserve.validation import format_validation_error

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PARITY_ENV",
    "PARITY_FLAGS",
    "PARITY_KNOBS",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
    "Condition",
    "ConditionType",
    "DisaggregatedModel",
    "DisaggregatedModelSpec",
    "DisaggregatedModelStatus",
    "EnginePoolSpec",
    "KvConnector",
    "Phase",
    "RoutingMode",
    "SpecError",
    "format_validation_error",
    "parse_resource",
    "parse_spec",
    "parse_stored",
]
