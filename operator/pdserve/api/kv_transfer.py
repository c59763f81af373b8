"""`spec.kvTransfer`: how prefill hands its KV cache to decode."""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, model_validator

from pdserve.api.base import ApiModel, CrossFieldRule, with_rules
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
    "decoder_kv_blocks_ttl": "kvTransfer.decodeBlocksTtlSeconds",
}


BIDIRECTIONAL_DECODE_TTL_SECONDS = 60
"""decoder_kv_blocks_ttl when bidirectional is on and decodeBlocksTtlSeconds unset. vLLM's
own default, 480 s, holds EVERY finished P/D request's KV on decode (streamed turns and
conversations that never come back included) for eight minutes: far past a multi-turn think
time, and the holds' share of decode's cache is sustained P/D rate x TTL x blocks per request
(docs/operations.md#held-kv). 60 s covers an agent's next call and a quick reply."""


class KvBufferDevice(StrEnum):
    cuda = "cuda"
    cpu = "cpu"


class TransportVerification(StrEnum):
    required = "Required"
    warn = "Warn"
    off = "Off"


def nixl_only(
    field: str, unset_cel: str, message: str, is_set: Callable[[KvTransferSpec], bool]
) -> CrossFieldRule[KvTransferSpec]:
    """A kvTransfer field only the NIXL connectors have; `unset_cel` is CEL for "not set"."""

    def check(kv: KvTransferSpec) -> str | None:
        if kv.connector not in NIXL_CONNECTORS and is_set(kv):
            return (
                f"{field} needs a NIXL connector (NixlConnector, NixlPushConnector), "
                f"not {kv.connector.value}"
            )
        return None

    return CrossFieldRule(f"{unset_cel} || {_NIXL_CEL}", message, f".{field}", check)


NIXL_ONLY = [
    nixl_only(
        "loadFailurePolicy",
        "!has(self.loadFailurePolicy)",
        "loadFailurePolicy needs a NIXL connector (NixlConnector, NixlPushConnector)",
        lambda kv: kv.load_failure_policy is not None,
    ),
    nixl_only(
        "leaseDurationSeconds",
        "!has(self.leaseDurationSeconds)",
        "leaseDurationSeconds needs a NIXL connector",
        lambda kv: kv.lease_duration_seconds is not None,
    ),
    nixl_only(
        "bidirectional",
        "!has(self.bidirectional) || !self.bidirectional",
        "bidirectional needs a NIXL connector",
        lambda kv: kv.bidirectional,
    ),
]


def _decode_ttl_needs_bidirectional(kv: KvTransferSpec) -> str | None:
    if kv.decode_blocks_ttl_seconds is not None and not kv.bidirectional:
        return (
            "decodeBlocksTtlSeconds needs bidirectional: true (decode holds a turn's KV for the "
            "next turn only with bidirectional KV transfer)"
        )
    return None


DECODE_TTL_NEEDS_BIDIRECTIONAL = CrossFieldRule(
    "!has(self.decodeBlocksTtlSeconds) || (has(self.bidirectional) && self.bidirectional)",
    "decodeBlocksTtlSeconds needs bidirectional: true",
    ".decodeBlocksTtlSeconds",
    _decode_ttl_needs_bidirectional,
)


class KvTransferSpec(ApiModel):
    """How prefill hands its KV cache to decode."""

    model_config = with_rules([*NIXL_ONLY, DECODE_TTL_NEEDS_BIDIRECTIONAL])

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
    decode_blocks_ttl_seconds: Annotated[int, Field(ge=1, le=86400)] | None = None
    """With bidirectional: how long decode holds a turn's KV for the next turn's prefill
    (decoder_kv_blocks_ttl); the gateway stops handing it out after this. Decode holds the KV
    of every finished P/D request this long, read back or not: the gateway keeps those holds
    within a share of decode's cache (past it, requests prefill on decode), so a shorter TTL
    lets more requests go P/D. Default 60 (vLLM's own is 480); size it as in
    docs/operations.md#held-kv."""
    kv_buffer_device: KvBufferDevice | None = None
    """Where the connector buffers KV for transfer (kv_buffer_device): cuda (GPU memory) or
    cpu (engines without a GPU, or staging through host memory). Default: vLLM's, cuda."""
    side_channel_port: Annotated[int, Field(ge=1024, le=65535)] = 5600
    """NIXL side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT; data-parallel rank is added)."""
    ucx_net_devices: Annotated[str, Field(min_length=1)] | None = None
    """UCX_NET_DEVICES, e.g. mlx5_0:1,mlx5_1:1 or all. It filters every UCX transport, TCP
    included, and applies to every TP rank of a pod: a device:port pin (an RDMA NIC) needs
    placement.rdma, and on multi-NIC nodes a single pin sends all ranks' KV through one NIC.
    Default: unset, UCX picks the NIC nearest each GPU."""
    ucx_transports: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """UCX_TLS, the UCX transports NIXL may use, e.g. rc,cuda_copy,cuda_ipc (leaving out tcp
    makes a broken RDMA path fail loudly instead of falling back; without placement.rdma it
    leaves no transport between pods, so it needs placement.rdma). Default: UCX's choice."""
    verify: TransportVerification = TransportVerification.warn
    """Transport preflight per slice (status.transport, condition TransportVerified).
    Required: the gateway keeps P/D routing off a slice until its KV path is verified (it
    prefills locally there). Warn: report only. Off: no preflight (quote it in YAML: a bare Off
    reads as false)."""
    extra_config: PreservedObject = Field(default_factory=dict)
    """More kv_connector_extra_config keys (e.g. num_threads, backends)."""

    @property
    def decode_blocks_ttl(self) -> int | None:
        """The decoder_kv_blocks_ttl the engines run with: None without bidirectional KV."""
        if not self.bidirectional:
            return None
        return self.decode_blocks_ttl_seconds or BIDIRECTIONAL_DECODE_TTL_SECONDS

    @model_validator(mode="after")
    def _first_class_extra_config(self) -> KvTransferSpec:
        # Python only: the CRD carries no CEL rule for extraConfig, whose keys are free-form.
        for key, field in FIRST_CLASS_EXTRA_CONFIG.items():
            if key in self.extra_config:
                raise ValueError(f"extraConfig.{key} is set by {field}; set it there instead")
        return self
