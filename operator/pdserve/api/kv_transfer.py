"""`spec.kvTransfer`: how prefill hands its KV cache to decode."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, model_validator

from pdserve.api.base import ApiModel, rule, with_rules
from pdserve.api.common import PreservedObject


class KvConnector(StrEnum):
    nixl = "NixlConnector"
    nixl_push = "NixlPushConnector"
    lmcache = "LMCacheConnectorV1"
    mooncake = "MooncakeConnector"


NIXL_CONNECTORS = (KvConnector.nixl, KvConnector.nixl_push)
# An unset connector defaults to NixlConnector.
_NIXL_CEL = "!has(self.connector) || self.connector.startsWith('Nixl')"
FIRST_CLASS_EXTRA_CONFIG = {
    "kv_lease_duration": "kvTransfer.leaseDurationSeconds",
    "bidirectional_kv_xfer": "kvTransfer.bidirectional",
}


class TransportVerification(StrEnum):
    required = "Required"
    warn = "Warn"
    off = "Off"


class KvTransferSpec(ApiModel):
    """How prefill hands its KV cache to decode."""

    model_config = with_rules(
        [
            rule(
                f"!has(self.loadFailurePolicy) || {_NIXL_CEL}",
                "loadFailurePolicy needs a NIXL connector (NixlConnector, NixlPushConnector)",
                ".loadFailurePolicy",
            ),
            rule(
                f"!has(self.leaseDurationSeconds) || {_NIXL_CEL}",
                "leaseDurationSeconds needs a NIXL connector",
                ".leaseDurationSeconds",
            ),
            rule(
                f"!has(self.bidirectional) || !self.bidirectional || {_NIXL_CEL}",
                "bidirectional needs a NIXL connector",
                ".bidirectional",
            ),
        ]
    )

    connector: KvConnector = KvConnector.nixl
    """vLLM KV connector."""
    lease_duration_seconds: Annotated[int, Field(ge=1, le=3600)] | None = None
    """How long prefill holds KV blocks for decode to pull (kv_lease_duration). NIXL only;
    vLLM's default is 30."""
    load_failure_policy: Literal["fail", "recompute"] | None = None
    """What decode does when a KV load fails: fail the request, or recompute the prefix
    (kv_load_failure_policy). NIXL only; vLLM's default is fail."""
    bidirectional: bool = False
    """Let prefill reuse KV that decode generated in a conversation (bidirectional_kv_xfer, set
    on both sides). NIXL only."""
    side_channel_port: Annotated[int, Field(ge=1024, le=65535)] = 5600
    """NIXL side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT; data-parallel rank is added)."""
    ucx_net_devices: Annotated[str, Field(min_length=1)] | None = None
    """UCX_NET_DEVICES, e.g. mlx5_0:1 or all. Default: UCX's choice."""
    ucx_transports: Annotated[str, Field(min_length=1)] | None = None
    """UCX_TLS, the UCX transports NIXL may use, e.g. rc,cuda_copy,cuda_ipc (leaving out tcp
    makes a broken RDMA path fail loudly instead of falling back). Default: UCX's choice."""
    verify: TransportVerification = TransportVerification.warn
    """Transport preflight per slice (status.transport, condition TransportVerified).
    Required: the gateway keeps P/D routing off a slice until its KV path is verified (it
    prefills locally there). Warn: report only. Off: no preflight (quote it in YAML: a bare Off
    reads as false)."""
    extra_config: PreservedObject = Field(default_factory=dict)
    """More kv_connector_extra_config keys (e.g. num_threads, backends)."""

    @model_validator(mode="after")
    def _nixl_only_fields(self) -> KvTransferSpec:
        if self.connector not in NIXL_CONNECTORS:
            for field, set_ in (
                ("loadFailurePolicy", self.load_failure_policy is not None),
                ("leaseDurationSeconds", self.lease_duration_seconds is not None),
                ("bidirectional", self.bidirectional),
            ):
                if set_:
                    raise ValueError(
                        f"{field} needs a NIXL connector (NixlConnector, NixlPushConnector), "
                        f"not {self.connector.value}"
                    )
        for key, field in FIRST_CLASS_EXTRA_CONFIG.items():
            if key in self.extra_config:
                raise ValueError(f"extraConfig.{key} is set by {field}; set it there instead")
        return self
