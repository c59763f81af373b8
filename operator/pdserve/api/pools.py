"""The engine pools (prefill and decode) and what every vLLM pool shares."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field

from pdserve.api.autoscaling import EngineAutoscalingSpec
from pdserve.api.base import ApiModel, CrossFieldRule, with_rules
from pdserve.api.common import EnvVar, LabelMap, PreservedObject
from pdserve.api.overrides import PodOverrides
from pdserve.api.requirements import ResourceRequirements, engine_default_resources


class SchedulerSpec(ApiModel):
    """vLLM scheduler knobs (chunked prefill). Unset: vLLM's defaults."""

    enable_chunked_prefill: bool | None = None
    """--enable-chunked-prefill / --no-enable-chunked-prefill."""
    max_num_batched_tokens: Annotated[int, Field(ge=1)] | None = None
    """Token budget of one engine step (--max-num-batched-tokens)."""
    max_num_seqs: Annotated[int, Field(ge=1)] | None = None
    """Most sequences in one step (--max-num-seqs)."""
    long_prefill_token_threshold: Annotated[int, Field(ge=0)] | None = None
    """Most prompt tokens one request may schedule per step; 0 = no cap
    (--long-prefill-token-threshold)."""


class All2allBackend(StrEnum):
    """vLLM 0.32's --all2all-backend choices for expert parallelism (config/parallel.py); the
    removed pplx and naive, the flashinfer_all2allv alias and the internal passthrough are left
    out."""

    allgather_reducescatter = "allgather_reducescatter"
    deepep_high_throughput = "deepep_high_throughput"
    deepep_low_latency = "deepep_low_latency"
    deepep_v2 = "deepep_v2"
    mori_high_throughput = "mori_high_throughput"
    mori_low_latency = "mori_low_latency"
    moonep = "moonep"
    nixl_ep = "nixl_ep"
    flashinfer_nvlink_two_sided = "flashinfer_nvlink_two_sided"
    flashinfer_nvlink_one_sided = "flashinfer_nvlink_one_sided"


class ExpertLoadBalancerSpec(ApiModel):
    """vLLM's expert-parallel load balancer (--enable-eplb, --eplb-config)."""

    num_redundant_experts: Annotated[int, Field(ge=0, le=1024)] = 0
    """Extra expert replicas spread over the ranks for hot experts (num_redundant_experts;
    llm-d's wide-EP guides use 32)."""


class ExpertParallelSpec(ApiModel):
    """Expert parallelism for MoE models (--enable-expert-parallel): the experts are spread
    over tensorParallelSize x dataParallelSize GPUs instead of sharded by TP."""

    all2all_backend: Annotated[All2allBackend | None, Field(alias="all2allBackend")] = None
    """--all2all-backend: how tokens reach their experts' ranks. Unset: vLLM's default,
    allgather_reducescatter. DeepEP backends need NVSHMEM and RDMA or multi-node NVLink."""
    load_balancer: ExpertLoadBalancerSpec | None = None
    """Rebalances experts at run time (--enable-eplb). Unset: off."""


class VllmPoolFields(ApiModel):
    """What every pool running a vLLM process has: its extra arguments, environment and
    where its pods go."""

    extra_args: list[str] = Field(default_factory=list)
    """Extra arguments of the pool's vLLM command. Parity flags and flags pdserve derives from
    other fields are refused, naming the field to use instead."""
    env: list[EnvVar] = Field(default_factory=list)
    """Extra environment variables (PYTHONHASHSEED and the NIXL/UCX/HF_TOKEN variables pdserve
    derives are refused)."""
    node_selector: LabelMap = Field(default_factory=dict)
    """Node labels the pool's pods require (for engines: merged with spec.placement)."""
    tolerations: list[PreservedObject] = Field(default_factory=list)
    """Tolerations of the pool's pods (for engines: added to spec.placement's)."""
    pod_annotations: LabelMap = Field(default_factory=dict)
    """Annotations on the pool's pods."""
    pod_overrides: PodOverrides = Field(default_factory=PodOverrides)
    """Pod fields of the cluster's own (priority, scheduler, runtime class, ServiceAccount,
    labels, volumes, init containers, sidecars, spread, affinity, securityContext), merged
    onto the pods pdserve builds."""


def _ranks_per_node(pool: EnginePoolSpec) -> str | None:
    nodes, ranks = pool.nodes_per_replica, pool.data_parallel_size
    if nodes == 1 or (ranks % nodes == 0 and ranks // nodes >= 2):
        return None
    low = max(2 * nodes, -(-ranks // nodes) * nodes)
    fewer = (f"nodesPerReplica to a divisor of {ranks} at most {ranks // 2}" if ranks >= 4
             else "nodesPerReplica 1")  # fmt: skip
    return (
        f"nodesPerReplica {nodes} with dataParallelSize {ranks}: each of the replica's "
        f"{nodes} pods runs dataParallelSize / nodesPerReplica ranks, so dataParallelSize "
        f"must be a multiple of {nodes} with at least 2 ranks per node (vLLM 0.32 fails to "
        f"start with 1 rank per node in hybrid load balancing): set dataParallelSize to {low}, "
        f"or {fewer}"
    )


RANKS_PER_NODE = CrossFieldRule(
    "!has(self.nodesPerReplica) || self.nodesPerReplica == 1 || (has(self.dataParallelSize) "
    "&& self.dataParallelSize % self.nodesPerReplica == 0 "
    "&& self.dataParallelSize >= 2 * self.nodesPerReplica)",
    "dataParallelSize must be a multiple of nodesPerReplica with at least 2 ranks per node",
    ".dataParallelSize",
    _ranks_per_node,
)


class EnginePoolSpec(VllmPoolFields):
    """A pool of GPU engines (prefill or decode): a StatefulSet, or a LeaderWorkerSet when a
    replica spans nodes."""

    model_config = with_rules([RANKS_PER_NODE])

    replicas: Annotated[int, Field(ge=0, le=1024)] = 1
    """Engine replicas: pods, or groups of nodesPerReplica pods when it is above 1.
    prefill.replicas 0 means aggregated serving on the decode pool.
    With placement.slices > 1: per slice (the P:D ratio). With autoscaling and one slice: the
    starting count, kept within its bounds."""
    tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    """GPUs one engine shards each layer over (--tensor-parallel-size)."""
    data_parallel_size: Annotated[int, Field(ge=1, le=1024)] = 1
    """Data-parallel ranks of one replica (--data-parallel-size), over all its nodes. GPUs per
    pod = tensorParallelSize x dataParallelSize / nodesPerReplica."""
    nodes_per_replica: Annotated[int, Field(ge=1, le=64)] = 1
    """Nodes one replica spans: 1 is one pod per replica (a StatefulSet); more makes each
    replica a LeaderWorkerSet group of this many pods, one per node, each running
    dataParallelSize / nodesPerReplica ranks (at least 2: vLLM 0.32 cannot serve one rank per
    node in hybrid load balancing). For MoE models with data-parallel attention."""
    expert_parallel: ExpertParallelSpec | None = None
    """Expert parallelism (MoE models only). Unset: off, unless extraArgs has
    --enable-expert-parallel (single-node pools)."""
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    """CPU and memory of the engine container; nvidia.com/gpu is derived and must not be set.
    On GPUs, a CPU or memory left unset (no request, no limit) is requested per GPU: 2 CPU and
    16Gi (docs/reference/crd.md, "Engine resources")."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    """Fraction of GPU memory vLLM may use (--gpu-memory-utilization)."""
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    """Scheduler knobs."""
    autoscaling: EngineAutoscalingSpec | None = None
    """Replicas from SLOs (Builtin) or from your own HPA/KEDA (External). Unset: replicas."""
    drain_seconds: Annotated[int, Field(ge=0, le=300)] = 5
    """On rollouts and scale-down an engine pod keeps serving this long after it is marked for
    deletion, so gateways stop sending it requests before SIGTERM closes its listener (vLLM
    then finishes in-flight requests for up to shutdownTimeoutSeconds)."""
    shutdown_timeout_seconds: Annotated[int, Field(ge=0, le=3600)] = 60
    """How long vLLM keeps generating the requests in flight after SIGTERM before it aborts
    what is left (--shutdown-timeout; vLLM's own default, 0, aborts them at once). The pod's
    terminationGracePeriodSeconds is drainSeconds + this + 30 s for the process to exit, so
    the kubelet never kills an engine that is still draining."""

    @property
    def multi_node(self) -> bool:
        return self.nodes_per_replica > 1

    @property
    def local_data_parallel_size(self) -> int:
        """Data-parallel ranks in one pod."""
        return self.data_parallel_size // self.nodes_per_replica

    @property
    def gpus(self) -> int:
        """GPUs of one pod (one node of a multi-node replica)."""
        return self.tensor_parallel_size * self.local_data_parallel_size

    def effective_resources(self, on_gpus: bool) -> ResourceRequirements:
        """resources, with per-GPU CPU and memory requests where unset when the engines run
        on GPUs; engines on CPU (simulators, vLLM's CPU backend) keep exactly what is set:
        their size depends on the model, not on a GPU count."""
        return engine_default_resources(self.resources, self.gpus) if on_gpus else self.resources
