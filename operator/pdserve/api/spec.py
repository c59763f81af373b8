"""`DisaggregatedModel.spec`: the one schema source for validation, defaults and the CRD. Its
parts live beside it (model, serving, pools, render, kv_transfer, gateway, placement,
autoscaling); the extraArgs/env rules in flags. The parity knobs are found on its fields."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import Field, model_validator

from pdserve.api.adapters import adapter_problems
from pdserve.api.autoscaling import EngineAutoscaler
from pdserve.api.base import ApiModel, CrossFieldRule, with_rules
from pdserve.api.fit import fit_problems, shape_of
from pdserve.api.flags import check_env, check_expert_parallel_args, check_extra_args
from pdserve.api.gateway import GatewaySpec
from pdserve.api.images import ImageSpec
from pdserve.api.kv_transfer import KvTransferSpec
from pdserve.api.model import ModelSpec
from pdserve.api.parity import ParityKnob, parity_knobs
from pdserve.api.placement import PlacementSpec
from pdserve.api.pools import EnginePoolSpec, VllmPoolFields
from pdserve.api.render import RenderSpec
from pdserve.api.requirements import guaranteed_resources
from pdserve.api.serving import (
    CPU_BLOCK_MULTIPLE,
    CPU_BLOCK_SIZE,
    ServingSpec,
    effective_block_size,
)


def _cpu_block_size(spec: DisaggregatedModelSpec) -> str | None:
    size = spec.serving.block_size
    if spec.placement.engines_on_cpu and size is not None and size % CPU_BLOCK_MULTIPLE:
        return (
            f'spec.serving.blockSize {size} on CPU engines (spec.placement.acceleratorResource ""):'
            f" vLLM's CPU backend needs a multiple of {CPU_BLOCK_MULTIPLE}; use 32, 64 or 128, or "
            f"leave it unset for {CPU_BLOCK_SIZE}"
        )
    return None


# Here, not on ServingSpec: whether the engines run on CPU is placement's to say. Absent
# placement or acceleratorResource means the default, an accelerator.
CPU_BLOCK_SIZE_RULE = CrossFieldRule(
    "!has(self.serving) || !has(self.serving.blockSize) "
    f"|| self.serving.blockSize % {CPU_BLOCK_MULTIPLE} == 0 "
    "|| !has(self.placement) || !has(self.placement.acceleratorResource) "
    "|| self.placement.acceleratorResource != ''",
    f"blockSize on CPU engines (empty placement.acceleratorResource) must be a multiple of "
    f"{CPU_BLOCK_MULTIPLE} for vLLM's CPU backend: use 32, 64 or 128, or leave it unset for "
    f"{CPU_BLOCK_SIZE}",
    ".serving.blockSize",
    _cpu_block_size,
)


def _nic_pin_without_rdma(spec: DisaggregatedModelSpec) -> str | None:
    devices = spec.kv_transfer.ucx_net_devices
    if devices is None or ":" not in devices or spec.placement.rdma is not None:
        return None
    return (
        f"spec.kvTransfer.ucxNetDevices {devices!r} pins an RDMA port (device:port), but "
        "spec.placement.rdma is unset, so the engine pods get no RDMA device: UCX_NET_DEVICES "
        "filters every transport, TCP included, so NIXL is left with no lane and the engines "
        "fail to start. Set spec.placement.rdma (resource, networks), or remove ucxNetDevices "
        "(UCX then picks the NIC nearest each GPU, or TCP)"
    )


# Here, not on KvTransferSpec: whether the pods get an RDMA device is placement's to say.
NIC_PIN_NEEDS_RDMA = CrossFieldRule(
    "!has(self.kvTransfer) || !has(self.kvTransfer.ucxNetDevices) "
    "|| !self.kvTransfer.ucxNetDevices.contains(':') "
    "|| (has(self.placement) && has(self.placement.rdma))",
    "kvTransfer.ucxNetDevices pins an RDMA port (device:port) but placement.rdma is unset: "
    "the pods get no RDMA device and UCX is left with no transport; set placement.rdma or "
    "remove ucxNetDevices",
    ".kvTransfer.ucxNetDevices",
    _nic_pin_without_rdma,
)


def _bidirectional_needs_render(spec: DisaggregatedModelSpec) -> str | None:
    if not spec.kv_transfer.bidirectional or spec.render.enabled:
        return None
    return (
        "spec.kvTransfer.bidirectional needs spec.render.enabled: the gateway reuses decode's KV "
        "for a conversation's next turn only on the render route (token ids), while decode "
        "holds every answer's KV for decodeBlocksTtlSeconds either way; without render those "
        "holds are never read and only crowd out new requests. Enable the render pool, or set "
        "bidirectional false"
    )


BIDIRECTIONAL_NEEDS_RENDER = CrossFieldRule(
    "!has(self.kvTransfer) || !has(self.kvTransfer.bidirectional) "
    "|| !self.kvTransfer.bidirectional "
    "|| !has(self.render) || !has(self.render.enabled) || self.render.enabled",
    "kvTransfer.bidirectional needs render.enabled: only the render route reuses decode's KV, "
    "and unread holds crowd out new requests",
    ".kvTransfer.bidirectional",
    _bidirectional_needs_render,
)


def tcp_left_out(transports: str) -> bool:
    """Whether UCX_TLS `transports` keeps tcp out: a plain list names the transports UCX may use
    (`all`: every one), a list starting with `^` the ones it may not."""
    items = transports.split(",")
    if items[0].startswith("^"):
        return "tcp" in (items[0][1:], *items[1:])
    return not {"tcp", "all"} & set(items)


def _transports_without_tcp_or_rdma(spec: DisaggregatedModelSpec) -> str | None:
    transports = spec.kv_transfer.ucx_transports
    if transports is None or spec.placement.rdma is not None or not tcp_left_out(transports):
        return None
    return (
        f"spec.kvTransfer.ucxTransports {transports!r} leaves tcp out, but spec.placement.rdma "
        "is unset, so the engine pods get no RDMA device: UCX has no transport left between "
        "prefill and decode pods (shared memory and cuda_ipc do not cross pods) and the engines "
        "fail to start (NIXL_ERR_BACKEND, no active messages transport). Set "
        "spec.placement.rdma, add tcp, or remove ucxTransports"
    )


# A `^` list (all but these) keeps tcp unless it names it; a plain list needs tcp or all.
TRANSPORTS_NEED_TCP_OR_RDMA = CrossFieldRule(
    "!has(self.kvTransfer) || !has(self.kvTransfer.ucxTransports) "
    "|| (has(self.placement) && has(self.placement.rdma)) "
    "|| (!self.kvTransfer.ucxTransports.startsWith('^') "
    "&& self.kvTransfer.ucxTransports.matches('(^|,)(tcp|all)(,|$)')) "
    "|| (self.kvTransfer.ucxTransports.startsWith('^') "
    "&& !(self.kvTransfer.ucxTransports == '^tcp' "
    "|| self.kvTransfer.ucxTransports.startsWith('^tcp,') "
    "|| self.kvTransfer.ucxTransports.matches(',tcp(,|$)')))",
    "kvTransfer.ucxTransports leaves tcp out but placement.rdma is unset: the pods get no RDMA "
    "device and UCX is left with no transport between them; set placement.rdma, add tcp, or "
    "remove ucxTransports",
    ".kvTransfer.ucxTransports",
    _transports_without_tcp_or_rdma,
)


class DisaggregatedModelSpec(ApiModel):
    """A disaggregated vLLM deployment: prefill and decode GPU pools, a CPU render pool and an
    OpenAI-compatible gateway, kept in parity."""

    model_config = with_rules(
        [
            CPU_BLOCK_SIZE_RULE,
            NIC_PIN_NEEDS_RDMA,
            TRANSPORTS_NEED_TCP_OR_RDMA,
            BIDIRECTIONAL_NEEDS_RENDER,
        ]
    )

    model: ModelSpec
    """The model to serve."""
    serving: ServingSpec = Field(default_factory=ServingSpec)
    """The parity set: tokenizer, chat template, parsers and engine-pair invariants."""
    image: ImageSpec = Field(default_factory=ImageSpec)
    """Container images."""
    prefill: EnginePoolSpec | None = None
    """Prefill pool (KV producer). Absent or replicas 0: aggregated serving on decode."""
    decode: EnginePoolSpec = Field(default_factory=EnginePoolSpec)
    """Decode pool (KV consumer, or the whole engine when aggregated)."""
    render: RenderSpec = Field(default_factory=RenderSpec)
    """CPU render pool."""
    kv_transfer: KvTransferSpec = Field(default_factory=KvTransferSpec)
    """Prefill -> decode KV transfer."""
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    """The gateway."""
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    """Placement of the GPU engine pools."""
    progress_deadline_seconds: Annotated[int, Field(ge=60, le=86400)] = 1800
    """How long a pod may take from creation to Ready (image pull, weights download, engine
    start) before the model reports Progressing=False and Degraded with reason
    ProgressDeadlineExceeded, naming the pod and what it waits on. Raise it for very large
    weights fetched from the Hub on every start (or keep them in spec.model.source.hf.cache)."""

    @model_validator(mode="after")
    def _no_parity_overrides(self) -> DisaggregatedModelSpec:
        pools: list[tuple[str, VllmPoolFields]] = [("decode", self.decode)]
        if self.prefill is not None:
            pools.insert(0, ("prefill", self.prefill))
        pools.append(("render", self.render))
        for name, pool in pools:
            check_extra_args(name, pool.extra_args, PARITY_FLAGS)
            check_env(name, pool.env, PARITY_ENV)
        derived: dict[str, str] = {}
        if self.placement.accelerator_resource:
            derived[self.placement.accelerator_resource] = "tensorParallelSize x dataParallelSize"
        if self.placement.rdma is not None:
            derived[self.placement.rdma.resource] = "placement.rdma.count"
        for name, engine in (("prefill", self.prefill), ("decode", self.decode)):
            if engine is None:
                continue
            for kind in ("requests", "limits"):
                for resource, source in derived.items():
                    if resource in getattr(engine.resources, kind):
                        raise ValueError(
                            f"spec.{name}.resources.{kind}[{resource}] is derived from "
                            f"{source}; remove it"
                        )
            if self.placement.wants_guaranteed_qos:
                on_gpus = bool(self.placement.accelerator_resource)
                guaranteed_resources(name, engine.effective_resources(on_gpus))
        self._check_engine_autoscaling()
        if problems := adapter_problems(self.model.adapters, self.model.lora):
            raise ValueError("; ".join(problems))
        self._check_side_channel_ports()
        self._check_multi_node()
        if problems := fit_problems(self):
            raise ValueError("; ".join(problems))
        return self

    def _check_side_channel_ports(self) -> None:
        """vLLM listens at sideChannelPort + data-parallel rank: every rank's port must exist."""
        port = self.kv_transfer.side_channel_port
        for name, pool in self.engine_pools():
            if port + pool.data_parallel_size - 1 > 65535:
                raise ValueError(
                    f"spec.kvTransfer.sideChannelPort {port}: NIXL listens on it plus each "
                    f"data-parallel rank, up to {port + pool.data_parallel_size - 1} for "
                    f"spec.{name}.dataParallelSize {pool.data_parallel_size}, past 65535; set "
                    f"sideChannelPort to at most {65536 - pool.data_parallel_size}"
                )

    def _check_multi_node(self) -> None:
        """Expert parallelism and replicas spanning nodes serve MoE models only: vLLM runs a
        dense model's data-parallel ranks as independent engines (v1/engine/core.py), so a
        group would only tie their failures together."""
        shape = shape_of(self)
        for name, pool in self.engine_pools():
            if pool.expert_parallel is not None:
                check_expert_parallel_args(name, pool.extra_args)
            if shape is None or not shape.dense:
                continue
            dense = f"{self.model.name} is a dense model (spec.model.shape.experts 0)"
            if pool.multi_node:
                raise ValueError(
                    f"spec.{name}.nodesPerReplica {pool.nodes_per_replica}: {dense}, and vLLM "
                    "runs a dense model's data-parallel ranks as independent engines, so a "
                    "replica spanning nodes only ties their failures together. Set "
                    f"nodesPerReplica 1 and raise spec.{name}.replicas instead"
                )
            if pool.expert_parallel is not None:
                raise ValueError(
                    f"spec.{name}.expertParallel: {dense} without experts to spread; remove it "
                    "(or set spec.model.shape for a MoE model pdserve takes for dense)"
                )

    def engine_pools(self) -> list[tuple[str, EnginePoolSpec]]:
        """The engine pools that run: ("prefill", ...) when disaggregated, then ("decode", ...)."""
        pools = [("prefill", self.prefill)] if self.disaggregated else []
        return [*pools, ("decode", self.decode)]  # type: ignore[list-item]

    def slice_bounds(self) -> tuple[int, int]:
        """(fewest, most) active slices when placement.slices > 1 and the engines autoscale:
        every autoscaled pool's minReplicas / maxReplicas in whole slices of its per-slice
        replicas, the most capped at placement.slices."""
        low, high = 1, self.placement.slices
        for _, pool in self.engine_pools():
            if pool.autoscaling is not None:
                low = max(low, math.ceil(pool.autoscaling.min_replicas / pool.replicas))
                high = min(high, pool.autoscaling.max_replicas // pool.replicas)
        return low, high

    def _check_engine_autoscaling(self) -> None:
        if self.prefill is not None and self.prefill.autoscaling and not self.prefill.replicas:
            raise ValueError(
                "spec.prefill.autoscaling needs spec.prefill.replicas >= 1 (0 means aggregated "
                "serving on decode): set replicas, or remove prefill.autoscaling"
            )
        auto = self.prefill.autoscaling if self.disaggregated and self.prefill else None
        builtin = auto is not None and auto.engine is EngineAutoscaler.builtin
        if builtin and self.gateway.slo.ttft_ms is None:
            raise ValueError(
                "spec.prefill.autoscaling (engine Builtin) scales prefill to the TTFT SLO: set "
                "spec.gateway.slo.ttftMs, or use engine External"
            )
        pools = self.engine_pools()
        scaled = [name for name, pool in pools if pool.autoscaling is not None]
        slices = self.placement.slices
        if slices == 1 or not scaled:
            return
        for name, pool in pools:
            if pool.autoscaling is None:
                raise ValueError(
                    f"spec.{scaled[0]}.autoscaling with placement.slices {slices}: the operator "
                    f"scales whole slices, so set spec.{name}.autoscaling too (or remove it)"
                )
            if pool.autoscaling.engine is EngineAutoscaler.external:
                raise ValueError(
                    f"spec.{name}.autoscaling.engine External cannot keep the P:D ratio and the "
                    f"topology domain across placement.slices ({slices}) StatefulSets: use "
                    "engine Builtin, which scales whole slices"
                )
        low, high = self.slice_bounds()
        if high < low:
            detail = ", ".join(
                f"{name} {pool.autoscaling.min_replicas}-{pool.autoscaling.max_replicas} "
                f"replicas of {pool.replicas} per slice"
                for name, pool in pools
                if pool.autoscaling is not None
            )
            raise ValueError(
                f"spec.decode.autoscaling: no whole number of slices fits every pool's bounds "
                f"({detail}, at most placement.slices {slices}): widen minReplicas/maxReplicas "
                "to multiples of the per-slice replicas"
            )

    @property
    def block_size(self) -> int:
        """The engines' KV block size: serving.blockSize, else derived from the backend."""
        return effective_block_size(self)

    @property
    def disaggregated(self) -> bool:
        """True when a prefill pool with replicas exists (P/D); False: aggregated on decode."""
        return self.prefill is not None and self.prefill.replicas > 0


# Every field declared with Parity (api/parity.py), in declaration order, and what is derived
# from them here: the flags and variables no pool's extraArgs or env may set (and the drift
# check compares on live workloads), each mapped to the field to set instead.
PARITY_KNOBS: tuple[ParityKnob, ...] = parity_knobs(DisaggregatedModelSpec)
PARITY_FLAGS: dict[str, str] = {k.flag: k.path for k in PARITY_KNOBS if k.flag is not None}
PARITY_ENV: dict[str, str] = {k.env: k.path for k in PARITY_KNOBS if k.env is not None}
