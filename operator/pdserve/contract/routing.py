"""Gateway configuration: the routing ConfigMap the operator writes (pools, parity hash, policy,
SLOs), plus, outside a cluster, a static list of endpoints with their parity hashes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from pdserve.validation import format_validation_error, without_unknown_fields

log = logging.getLogger("pdserve.gateway")

ROUTING_KEY = "routing.json"  # the ConfigMap's key, mounted as ROUTING_DIR/ROUTING_KEY
SCHEMA_VERSION = 4
"""The routing file's schema as this pdserve writes and reads it (a file without
`schemaVersion` is 1). The skew rule, which lets the operator and the gateways roll separately
(an operator upgrade or rollback, a gateway image pinned in spec.image.gateway): a gateway
reads a file of its own version or older, since every key added later has a default; it reads
a newer file too, leaving out the keys it does not know (logged, so what the newer operator
asked for is seen to be off until the gateway is upgraded). A key may be added, never renamed
or given another meaning; each added key raises SCHEMA_VERSION. A key this gateway does not
know in a file of its own version or older is an error: a typo in a hand-written file. A file is
written with the lowest version that knows every key it holds (written_version), so a model
that uses no newer key keeps its file, and its gateway's config hash, across an upgrade."""
# The schema version that added each key (after version 3).
KEYS_SINCE = {"adapters": 4}


class _Model(BaseModel):
    # Unknown keys are errors: the operator and the gateway ship in one image, so a key the
    # gateway does not know is a renamed or misspelt one, never a newer feature.
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class PoolRef(_Model):
    service: str
    port: int
    selector: dict[str, str] = Field(default_factory=dict)
    kv_compat: str | None = None
    """Prefill and decode with P/D: the KV-compatibility digest the spec gives the pool's pods
    (pdserve.io/kv-compat). Pods of an older spec carry their own until they roll."""
    data_parallel_local: int = Field(default=1, ge=1)
    """Engine pools: the data-parallel ranks each pod serves (dataParallelSize /
    nodesPerReplica); above 1 the gateway routes to each rank (schema version 3)."""


class Pools(_Model):
    render: PoolRef | None = None
    prefill: PoolRef | None = None
    decode: PoolRef
    gateway: PoolRef | None = None
    """The gateway's own replicas (peers in the cluster-wide prefill admission)."""


class Slo(_Model):
    # Milliseconds; fractions allowed (a time-scaled benchmark's budgets are). An int stays an
    # int, so the ConfigMap text (and its hash, which rolls the gateways) reads as the spec does.
    ttft_ms: int | float | None = None
    itl_ms: int | float | None = None

    @property
    def ttft_seconds(self) -> float | None:
        return None if self.ttft_ms is None else self.ttft_ms / 1000

    @property
    def itl_seconds(self) -> float | None:
        return None if self.itl_ms is None else self.itl_ms / 1000


class Routing(_Model):
    mode: Literal["Auto", "Disaggregated", "Aggregated"] = "Auto"
    slo: Slo = Field(default_factory=Slo)


# vLLM's defaults (NixlConnector's kv_connector_extra_config), for a spec that leaves them unset.
VLLM_KV_LEASE_SECONDS = 30
VLLM_DECODER_KV_BLOCKS_TTL_SECONDS = 480


class KvTransfer(_Model):
    connector: str = "NixlConnector"
    # The engines' lease and TTL as durations, not the engines' expiry times: those are read
    # off each engine's own monotonic clock (vLLM's time.perf_counter()), meaningless here.
    # An int stays an int, as in Slo.
    prefill_lease_seconds: int | float = Field(default=VLLM_KV_LEASE_SECONDS, gt=0)
    """How long prefill holds a finished prefill's KV for decode to pull (kv_lease_duration):
    a decode not sent within it, less the gateway's margin, prefills locally instead."""
    decode_blocks_ttl_seconds: int | float = Field(default=VLLM_DECODER_KV_BLOCKS_TTL_SECONDS, gt=0)
    """How long decode holds a turn's KV for the next turn's prefill (decoder_kv_blocks_ttl,
    bidirectional only)."""
    load_failure_policy: str | None = None
    bidirectional: bool = False
    verify: Literal["Required", "Warn", "Off"] = "Warn"


class StaticEndpoint(_Model):
    url: str
    parity_hash: str | None = None
    kv_compat: str | None = None
    """Prefill and decode: its KV-compatibility digest; unset pairs only with unset."""
    slice: str | None = None
    kv_transport: str | None = None
    name: str | None = None  # names the replica in metrics (in a cluster: the pod name)
    data_parallel_local: int = Field(default=1, ge=1)
    """Engines: the data-parallel ranks its server manages (vLLM's --data-parallel-size, or
    --data-parallel-size-local); above 1 the gateway routes to each rank."""


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
    schema_version: int = Field(default=1, ge=1)
    """SCHEMA_VERSION of the pdserve that wrote the file."""
    model: str
    namespace: str = "default"
    parity_hash: str | None = None
    engine_api: Literal["tokens", "openai"] = "tokens"
    tokens_engines: Literal["scale_out", "tokens_only"] = "scale_out"
    """What the engines behind a render pool run (engine_api tokens): scale_out (`vllm serve
    --enable-scale-out`, with a tokenizer: every request) or tokens_only (`--tokens-only`: no
    stop strings, structured outputs or forced tool calls, which the gateway refuses)."""
    block_size: int = Field(default=16, ge=1)
    routing: Routing = Field(default_factory=Routing)
    pools: Pools
    kv_transfer: KvTransfer = Field(default_factory=KvTransfer)
    adapters: list[str] = Field(default_factory=list)
    """LoRA adapters every engine serves beside the model (spec.model.adapters): a request
    names one in `model`, and its answer is the adapter's."""
    replica_check: Literal["Enforce", "Off"] = "Off"
    """Enforce: check every replica before it takes traffic, keep out the ones that disagree
    (gateway/replica_contract.py). The operator writes spec.gateway.replicaCheck (default
    Enforce); a hand-written file routes unchecked unless it asks."""
    endpoints: StaticEndpoints | None = None

    @property
    def tokens_only_engines(self) -> bool:
        """The engines load no tokenizer: requests that need one are refused at intake."""
        return self.engine_api == "tokens" and self.tokens_engines == "tokens_only"


def written_version(config: GatewayConfig) -> int:
    """The lowest schema version that knows every key set in `config` (3 at least)."""
    used = config.model_dump(by_alias=True, exclude_unset=True)
    return max([3, *(since for key, since in KEYS_SINCE.items() if key in used)])


def config_text_of(config: GatewayConfig) -> str:
    """The ConfigMap's text: indented and sorted, so a GitOps diff shows which setting changed;
    fields left unset are left out (a static `endpoints` list is for runs outside a cluster)."""
    body = config.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return json.dumps(body, indent=2, sort_keys=True) + "\n"


UNKNOWN_KEY = (
    "unknown key; the operator writes this file, so run the gateway image of the operator's "
    "pdserve version (a hand-written file: check the key's spelling)"
)


class ConfigError(ValueError):
    pass


def load_config(path: Path) -> GatewayConfig:
    """Parse the routing file by the skew rule (SCHEMA_VERSION); ConfigError names the file
    and every bad field."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path}: {error}") from None
    version = raw.get("schemaVersion", 1) if isinstance(raw, dict) else 1
    if isinstance(version, int) and version > SCHEMA_VERSION:
        raw, newer = without_unknown_fields(GatewayConfig, raw)
        if newer:
            log.warning(
                "%s: schema version %d, newer than this gateway's %d: left out %s (off until "
                "the gateway runs the operator's pdserve version)",
                path, version, SCHEMA_VERSION, ", ".join(newer),
            )  # fmt: skip
    try:
        return GatewayConfig.model_validate(raw)
    except ValidationError as error:
        problems = format_validation_error(error, unknown_field=UNKNOWN_KEY)
        raise ConfigError(f"{path}: " + "; ".join(problems)) from None
