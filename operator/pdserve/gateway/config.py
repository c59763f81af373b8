"""Gateway configuration: the routing ConfigMap the operator writes (pools, parity hash, policy,
SLOs), plus, outside a cluster, a static list of endpoints with their parity hashes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from pdserve.api.resource import format_validation_error


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )


class PoolRef(_Model):
    service: str
    port: int
    selector: dict[str, str] = Field(default_factory=dict)


class Pools(_Model):
    render: PoolRef | None = None
    prefill: PoolRef | None = None
    decode: PoolRef
    gateway: PoolRef | None = None
    """The gateway's own replicas (peers in the cluster-wide prefill admission)."""


class Slo(_Model):
    # Milliseconds; fractions allowed (a time-scaled benchmark's budgets are).
    ttft_ms: float | None = None
    itl_ms: float | None = None


class Routing(_Model):
    mode: Literal["Auto", "Disaggregated", "Aggregated"] = "Auto"
    slo: Slo = Field(default_factory=Slo)


class KvTransfer(_Model):
    connector: str = "NixlConnector"
    lease_duration_seconds: int | None = None
    load_failure_policy: str | None = None
    bidirectional: bool = False
    verify: Literal["Required", "Warn", "Off"] = "Warn"


class StaticEndpoint(_Model):
    url: str
    parity_hash: str | None = None
    slice: str | None = None
    kv_transport: str | None = None
    name: str | None = None  # names the replica in metrics (in a cluster: the pod name)


class StaticEndpoints(_Model):
    """Endpoints outside a cluster (tests, demos): the same parity gating applies."""

    render: list[StaticEndpoint] = Field(default_factory=list)
    prefill: list[StaticEndpoint] = Field(default_factory=list)
    decode: list[StaticEndpoint] = Field(default_factory=list)
    peers: list[str] = Field(default_factory=list)
    """Other gateway replicas' base URLs (their /admission) for the shared long-prefill limit."""
    self_url: str | None = None
    """This replica's own base URL as its peers list it: with it, the replicas elect one that
    admits every long prefill (exact limit); without, each admits on its own."""


class GatewayConfig(_Model):
    model: str
    namespace: str = "default"
    parity_hash: str | None = None
    engine_api: Literal["tokens", "openai"] = "tokens"
    block_size: int = Field(default=16, ge=1)
    routing: Routing = Field(default_factory=Routing)
    pools: Pools
    kv_transfer: KvTransfer = Field(default_factory=KvTransfer)
    endpoints: StaticEndpoints | None = None


class ConfigError(ValueError):
    pass


def load_config(path: Path) -> GatewayConfig:
    """Parse the routing file; ConfigError names the file and every bad field."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path}: {error}") from None
    try:
        return GatewayConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(f"{path}: " + "; ".join(format_validation_error(error))) from None
