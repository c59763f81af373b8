"""The engine pools (prefill and decode) and what every vLLM pool shares."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pdserve.api.autoscaling import EngineAutoscalingSpec
from pdserve.api.base import ApiModel
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


class EnginePoolSpec(VllmPoolFields):
    """A pool of GPU engines (prefill or decode), one StatefulSet."""

    replicas: Annotated[int, Field(ge=0, le=1024)] = 1
    """Engine replicas (pods). prefill.replicas 0 means aggregated serving on the decode pool.
    With placement.slices > 1: per slice (the P:D ratio). With autoscaling and one slice: the
    starting count, kept within its bounds."""
    tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    """GPUs one engine shards each layer over (--tensor-parallel-size)."""
    data_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    """Engine data-parallel ranks in one pod (--data-parallel-size). GPUs per pod =
    tensorParallelSize x dataParallelSize."""
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
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    def effective_resources(self, on_gpus: bool) -> ResourceRequirements:
        """resources, with per-GPU CPU and memory requests where unset when the engines run
        on GPUs; engines on CPU (simulators, vLLM's CPU backend) keep exactly what is set:
        their size depends on the model, not on a GPU count."""
        return engine_default_resources(self.resources, self.gpus) if on_gpus else self.resources
