"""`DisaggregatedModel.spec`: the one schema source for validation, defaults and the CRD."""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, JsonValue, model_validator

from pdserve.api.base import ApiModel, rule, with_rules

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

GPU_RESOURCE = "nvidia.com/gpu"


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


# CEL rules below guard every field with has(): the API server checks them against the schema
# defaults ({}) before nested defaults are filled in.


# ---- model -----------------------------------------------------------------------------------
class HuggingFaceSource(ApiModel):
    """Download the model from the Hugging Face Hub when a pod starts."""

    token_secret_ref: SecretKeyRef | None = None
    """Secret key holding an HF token (exported as HF_TOKEN), for gated or private models. The
    token is only ever read from this Secret, never written into a manifest."""


class PvcSource(ApiModel):
    """Load the model from a PersistentVolumeClaim mounted read-only into every pod."""

    claim_name: Annotated[str, Field(min_length=1, max_length=253)]
    """Name of the PersistentVolumeClaim (ReadOnlyMany or ReadWriteMany for several pods)."""
    path: Annotated[str, Field(pattern=r"^[^/].*$")] = "."
    """Directory of the model inside the claim, relative to its root."""


class ModelSource(ApiModel):
    """Where weights, config and tokenizer come from: exactly one of hf or pvc."""

    model_config = with_rules(
        [rule("!(has(self.hf) && has(self.pvc))", "set only one of hf and pvc")]
    )

    hf: HuggingFaceSource | None = None
    """The Hugging Face Hub (the default when nothing is set)."""
    pvc: PvcSource | None = None
    """A PersistentVolumeClaim."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if self.hf is not None and self.pvc is not None:
            raise ValueError("set only one of hf and pvc")
        return self


class ModelSpec(ApiModel):
    """The model being served."""

    name: Annotated[str, Field(min_length=1, max_length=512)]
    """Hugging Face id (e.g. Qwen/Qwen2.5-7B-Instruct) or, with source.pvc, the name clients use
    when servedModelName is not set."""
    served_model_name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """Model name in the OpenAI API. Default: the resource's metadata.name."""
    revision: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    """Model revision (branch, tag or commit). Pinned revisions keep pools identical."""
    source: ModelSource = Field(default_factory=ModelSource)
    """Where the model is loaded from."""
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    """Context length (--max-model-len). Default: the model's own."""


# ---- serving: the parity set -------------------------------------------------------------------
class KvCacheDtype(StrEnum):
    auto = "auto"
    fp8 = "fp8"
    fp8_e4m3 = "fp8_e4m3"
    fp8_e5m2 = "fp8_e5m2"


class ServingSpec(ApiModel):
    """Everything that changes how text becomes tokens and tokens become an answer, written once
    and rendered identically into the render, prefill and decode pools (the parity set)."""

    model_config = with_rules(
        [
            rule(
                "!has(self.enableAutoToolChoice) || !self.enableAutoToolChoice"
                " || has(self.toolCallParser)",
                "enableAutoToolChoice needs toolCallParser",
                ".enableAutoToolChoice",
            )
        ]
    )

    tokenizer: Annotated[str, Field(min_length=1)] | None = None
    """Tokenizer (--tokenizer). Default: the model's own."""
    tokenizer_revision: Annotated[str, Field(min_length=1)] | None = None
    """Tokenizer revision (--tokenizer-revision)."""
    chat_template: ConfigMapKeyRef | None = None
    """Chat template from a ConfigMap key (--chat-template). Default: the model's own."""
    default_chat_template_kwargs: PreservedObject | None = None
    """Default chat-template kwargs (--default-chat-template-kwargs), e.g. {"enable_thinking":
    false}. Request kwargs win."""
    reasoning_parser: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")] | None = (
        None
    )
    """Reasoning parser (--reasoning-parser), e.g. qwen3, deepseek_r1."""
    tool_call_parser: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")] | None = (
        None
    )
    """Tool-call parser (--tool-call-parser), e.g. hermes, llama3_json."""
    enable_auto_tool_choice: bool = False
    """Let the model choose tools (--enable-auto-tool-choice); needs toolCallParser."""
    block_size: Literal[1, 8, 16, 32, 64, 128] = 16
    """KV cache block size in tokens (--block-size); must match between prefill and decode."""
    kv_cache_dtype: KvCacheDtype = KvCacheDtype.auto
    """KV cache dtype (--kv-cache-dtype); must match between prefill and decode."""
    python_hash_seed: Annotated[int, Field(ge=0, le=4294967295)] = 0
    """PYTHONHASHSEED for every pool, so prefix-cache block hashes agree across pods."""

    @model_validator(mode="after")
    def _auto_tool_choice_needs_parser(self) -> ServingSpec:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "enableAutoToolChoice needs toolCallParser: set spec.serving.toolCallParser "
                "(e.g. hermes) or drop enableAutoToolChoice"
            )
        return self


# ---- images ------------------------------------------------------------------------------------
DEFAULT_ENGINE_IMAGE = "vllm/vllm-openai:v0.33.0"
DEFAULT_GATEWAY_IMAGE = "ghcr.io/pdserve/pdserve:0.1.0"


class ImageSpec(ApiModel):
    """Container images."""

    engine: Annotated[str, Field(min_length=1)] = DEFAULT_ENGINE_IMAGE
    """vLLM image for the prefill and decode engines (GPU build)."""
    render: Annotated[str, Field(min_length=1)] | None = None
    """vLLM image for the render pool; a CPU build saves pulling CUDA. Default: engine."""
    gateway: Annotated[str, Field(min_length=1)] = DEFAULT_GATEWAY_IMAGE
    """pdserve gateway image."""
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """imagePullPolicy of every container."""
    pull_secrets: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    """Names of image pull Secrets for every pod."""


# ---- pools -------------------------------------------------------------------------------------
class ResourceRequirements(ApiModel):
    """CPU, memory and other resources, as in a container's resources."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Requested resources."""
    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Resource limits."""


def guaranteed_resources(pool: str, spec: ResourceRequirements) -> dict[str, Quantity]:
    """CPU and memory for requests == limits; refuses what cannot be made Guaranteed."""
    out: dict[str, Quantity] = {}
    for resource in ("cpu", "memory"):
        request, limit = spec.requests.get(resource), spec.limits.get(resource)
        if request is None and limit is None:
            raise ValueError(
                f"spec.{pool}.resources.requests.{resource} is needed: placement.guaranteedQoS "
                "(on by default with placement.rdma) makes requests == limits; set it, or set "
                "placement.guaranteedQoS: false"
            )
        if request is not None and limit is not None and str(request) != str(limit):
            raise ValueError(
                f"spec.{pool}.resources: requests.{resource} ({request}) differs from "
                f"limits.{resource} ({limit}), but placement.guaranteedQoS needs them equal"
            )
        out[resource] = request if request is not None else limit  # type: ignore[assignment]
    return out


class EnvVar(ApiModel):
    """An environment variable, as in a container's env."""

    name: Annotated[str, Field(min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")]
    """Variable name."""
    value: str | None = None
    """Literal value."""
    value_from: PreservedObject | None = None
    """Source of the value (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef)."""


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


# Flags that change how text becomes tokens or how prefill and decode agree: set once, in spec.
PARITY_FLAGS: dict[str, str] = {
    "--chat-template": "spec.serving.chatTemplate",
    "--tokenizer": "spec.serving.tokenizer",
    "--tokenizer-revision": "spec.serving.tokenizerRevision",
    "--revision": "spec.model.revision",
    "--reasoning-parser": "spec.serving.reasoningParser",
    "--tool-call-parser": "spec.serving.toolCallParser",
    "--enable-auto-tool-choice": "spec.serving.enableAutoToolChoice",
    "--default-chat-template-kwargs": "spec.serving.defaultChatTemplateKwargs",
    "--block-size": "spec.serving.blockSize",
    "--kv-cache-dtype": "spec.serving.kvCacheDtype",
}
PARITY_ENV: dict[str, str] = {"PYTHONHASHSEED": "spec.serving.pythonHashSeed"}

# Flags and env the operator derives from other fields; setting them twice would silently fight.
OWNED_FLAGS: dict[str, str] = {
    "--model": "spec.model.name",
    "--served-model-name": "spec.model.servedModelName",
    "--max-model-len": "spec.model.maxModelLen",
    "--port": "the operator (engines listen on 8000)",
    "--host": "the operator",
    "--tokens-only": "the operator (set when the render pool is enabled)",
    "--kv-transfer-config": "spec.kvTransfer",
    "--tensor-parallel-size": "spec.<pool>.tensorParallelSize",
    "--data-parallel-size": "spec.<pool>.dataParallelSize",
    "--gpu-memory-utilization": "spec.<pool>.gpuMemoryUtilization",
    "--enable-chunked-prefill": "spec.<pool>.scheduler.enableChunkedPrefill",
    "--max-num-batched-tokens": "spec.<pool>.scheduler.maxNumBatchedTokens",
    "--max-num-seqs": "spec.<pool>.scheduler.maxNumSeqs",
    "--long-prefill-token-threshold": "spec.<pool>.scheduler.longPrefillTokenThreshold",
    "--renderer-num-workers": "spec.render.workers",
}
OWNED_ENV: dict[str, str] = {
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "the operator (the pod IP)",
    "VLLM_NIXL_SIDE_CHANNEL_PORT": "spec.kvTransfer.sideChannelPort",
    "UCX_NET_DEVICES": "spec.kvTransfer.ucxNetDevices",
    "UCX_TLS": "spec.kvTransfer.ucxTransports",
    "HF_TOKEN": "spec.model.source.hf.tokenSecretRef",
}


def normalize_flag(arg: str) -> str | None:
    """`--Tool_Call_Parser=x` -> `--tool-call-parser`; `--no-enable-x` -> `--enable-x`;
    None for values and short options."""
    if not arg.startswith("--"):
        return None
    name = arg.split("=", 1)[0].lower().replace("_", "-")
    if name.startswith("--no-"):
        name = "--" + name[len("--no-") :]
    return name


def check_extra_args(pool: str, args: list[str]) -> None:
    """Refuse extraArgs that set a parity flag or a flag the operator owns, naming both."""
    for index, arg in enumerate(args):
        flag = normalize_flag(arg)
        if flag in PARITY_FLAGS:
            raise ValueError(
                f"spec.{pool}.extraArgs[{index}] sets parity flag {flag}: it must be identical "
                f"in every pool, so set it once in {PARITY_FLAGS[flag]}"
            )
        if flag in OWNED_FLAGS:
            owner = OWNED_FLAGS[flag].replace("<pool>", pool)
            raise ValueError(
                f"spec.{pool}.extraArgs[{index}] sets {flag}, which is derived from {owner}; "
                "set it there instead"
            )


def check_env(pool: str, env: list[EnvVar]) -> None:
    for index, var in enumerate(env):
        if var.name in PARITY_ENV:
            raise ValueError(
                f"spec.{pool}.env[{index}] sets parity variable {var.name}: it must be identical "
                f"in every pool, so set it once in {PARITY_ENV[var.name]}"
            )
        if var.name in OWNED_ENV:
            raise ValueError(
                f"spec.{pool}.env[{index}] sets {var.name}, which is derived from "
                f"{OWNED_ENV[var.name]}; set it there instead"
            )


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


# Subclasses that add CEL rules replace the parent's list: each repeats this one.
MIN_MAX_REPLICAS = rule(
    "!has(self.maxReplicas) || !has(self.minReplicas) || self.maxReplicas >= self.minReplicas",
    "maxReplicas must be >= minReplicas",
    ".maxReplicas",
)


class ScalingBehaviour(ApiModel):
    """How fast an autoscaler may move: bounds, stabilization windows against flapping, steps
    and cooldowns. The same semantics for every engine (the HPA/KEDA behaviour fields are derived
    from them; the Builtin engine applies them itself)."""

    model_config = with_rules([MIN_MAX_REPLICAS])

    min_replicas: Annotated[int, Field(ge=1, le=1000)] = 1
    """Fewest replicas."""
    max_replicas: Annotated[int, Field(ge=1, le=1000)] = 4
    """Most replicas."""
    scale_up_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = 0
    """A scale-up follows the lowest recommendation of this window (a short spike does not
    add replicas)."""
    scale_down_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = 300
    """A scale-down follows the highest recommendation of this window (load must stay low this
    long before replicas go)."""
    scale_up_step: Annotated[int, Field(ge=1, le=1000)] = 4
    """Most replicas added in one step."""
    scale_down_step: Annotated[int, Field(ge=1, le=1000)] = 1
    """Most replicas removed in one step."""
    cooldown_seconds: Annotated[int, Field(ge=0, le=1800)] = 30
    """After a step, no further step in the same direction for this long (the HPA policy's
    periodSeconds)."""

    @model_validator(mode="after")
    def _bounds(self) -> ScalingBehaviour:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"maxReplicas ({self.max_replicas}) must be >= minReplicas ({self.min_replicas})"
            )
        return self


class EngineAutoscaler(StrEnum):
    builtin = "Builtin"
    external = "External"


class EngineAutoscalingSpec(ScalingBehaviour):
    """SLO-driven autoscaling of an engine pool. Builtin: the operator scrapes the engines and
    sets the StatefulSets' replicas (prefill from queued prompt tokens and measured prefill
    throughput against the TTFT SLO; decode from KV-cache use and ITL against the ITL SLO; with
    placement.slices > 1 whole slices, so P:D and the topology domain hold). External: your
    HPA or KEDA ScaledObject drives the StatefulSet's /scale; the operator never sets its
    replicas."""

    engine: EngineAutoscaler = EngineAutoscaler.builtin
    """Builtin (the operator) or External (an HPA/KEDA targeting the StatefulSet
    <name>-prefill or <name>-decode; one slice only)."""
    min_replicas: Annotated[int, Field(ge=1, le=1024)] = 1
    """Fewest engine pods of the pool (all slices together)."""
    max_replicas: Annotated[int, Field(ge=1, le=1024)] = 4
    """Most engine pods of the pool (all slices together)."""
    target_utilization_percent: Annotated[int, Field(ge=10, le=100)] = 80
    """prefill: share of the measured prefill throughput (prompt tokens per busy second) the
    pool may be loaded to; decode: KV-cache usage the pool aims for."""
    scale_up_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = 60
    """A scale-up follows the lowest recommendation of this window (GPU pods are expensive:
    load must stay high this long)."""
    scale_down_stabilization_seconds: Annotated[int, Field(ge=0, le=3600)] = 600
    """A scale-down follows the highest recommendation of this window."""
    scale_up_step: Annotated[int, Field(ge=1, le=1024)] = 1
    """Most replicas (or slices) added in one step."""
    scale_down_step: Annotated[int, Field(ge=1, le=1024)] = 1
    """Most replicas (or slices) removed in one step."""
    cooldown_seconds: Annotated[int, Field(ge=0, le=1800)] = 300
    """After a step, no further step in the same direction for this long (engines load weights
    for minutes before they take load)."""


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
    """CPU and memory of the engine container; nvidia.com/gpu is derived and must not be set."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    """Fraction of GPU memory vLLM may use (--gpu-memory-utilization)."""
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    """Scheduler knobs."""
    autoscaling: EngineAutoscalingSpec | None = None
    """Replicas from SLOs (Builtin) or from your own HPA/KEDA (External). Unset: replicas."""

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size


class RenderAutoscaler(StrEnum):
    hpa = "HPA"
    keda = "KEDA"
    builtin = "Builtin"


class RenderAutoscalingSpec(ScalingBehaviour):
    """Autoscaling of the render pool on parser load: busy seconds per second of the render
    servers' render/derender handlers (their http_request_duration_seconds, and the gateway's
    own per-replica derender timing) per worker, with CPU utilization as the floor signal."""

    model_config = with_rules(
        [
            MIN_MAX_REPLICAS,
            rule(
                "!has(self.engine) || self.engine != 'KEDA' || has(self.prometheusAddress)",
                "engine KEDA needs prometheusAddress (the Prometheus its trigger queries)",
                ".prometheusAddress",
            ),
        ]
    )

    enabled: bool = True
    """Autoscale the render pool and leave the Deployment's replicas to the autoscaler."""
    engine: RenderAutoscaler = RenderAutoscaler.hpa
    """HPA: an autoscaling/v2 HorizontalPodAutoscaler on CPU plus the Pods metric
    pdserve_render_parser_busy (served by the Prometheus Adapter rule the chart ships). KEDA: a
    keda.sh ScaledObject with a Prometheus and a CPU trigger. Builtin: the operator scrapes the
    render pods and gateways itself and sets replicas (clusters with neither adapter)."""
    target_cpu_utilization_percentage: Annotated[
        int, Field(ge=1, le=100, alias="targetCPUUtilizationPercentage")
    ] = 70
    """Average CPU utilization (of the CPU request) aimed for: the floor signal."""
    target_parser_busy_percent: Annotated[int, Field(ge=10, le=100)] = 70
    """Busy seconds per second of render/derender work per worker aimed for (100: every worker
    always busy). Over it, derender calls queue and streamed tokens stall."""
    prometheus_address: Annotated[str, Field(pattern=r"^https?://.+")] | None = None
    """Prometheus URL the KEDA trigger queries, e.g.
    http://prometheus-operated.monitoring.svc:9090 (engine KEDA)."""

    @model_validator(mode="after")
    def _keda_needs_prometheus(self) -> RenderAutoscalingSpec:
        if self.engine is RenderAutoscaler.keda and self.prometheus_address is None:
            raise ValueError(
                "render.autoscaling.engine KEDA needs render.autoscaling.prometheusAddress (the "
                "Prometheus its trigger queries, e.g. http://prometheus-operated.monitoring.svc"
                ":9090), or use engine HPA or Builtin"
            )
        return self


def cpu_cores(quantity: Quantity | None) -> float | None:
    """A CPU quantity in cores: "250m" -> 0.25, "2" or 2 -> 2.0; None when unset or unreadable."""
    if quantity is None:
        return None
    text = str(quantity).strip()
    try:
        return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        return None


class RenderSpec(VllmPoolFields):
    """The CPU render pool (`vllm launch render`): chat templates, tokenizing, reasoning and
    tool-call parsing, for both /render and /derender."""

    enabled: bool = True
    """Run a render pool; engines then run --tokens-only. false: engines speak OpenAI."""
    replicas: Annotated[int, Field(ge=1, le=1000)] = 2
    """Replicas when autoscaling is disabled."""
    workers: Annotated[int, Field(ge=1, le=256)] | None = None
    """Render worker threads per pod (--renderer-num-workers). Default: one per requested CPU
    core (resources.requests.cpu, rounded up); without a CPU request, 1 and a 1-core request."""
    resources: ResourceRequirements = Field(
        default_factory=lambda: ResourceRequirements(
            requests={"memory": "2Gi"}, limits={"memory": "4Gi"}
        )
    )
    """CPU and memory of the render container. Unset requests.cpu: one core per worker."""
    drain_seconds: Annotated[int, Field(ge=0, le=300)] = 5
    """On scale-down (and rollouts) a render pod keeps serving this long after it is marked for
    deletion, so gateways stop picking it before its in-flight derender calls are drained (the
    server then finishes them on SIGTERM). Render is stateless: a stream's next chunk goes to
    another replica."""
    autoscaling: RenderAutoscalingSpec = Field(default_factory=RenderAutoscalingSpec)
    """Autoscaling on parser load (HPA, KEDA or the operator's Builtin loop)."""

    @property
    def worker_count(self) -> int:
        if self.workers is not None:
            return self.workers
        cores = cpu_cores(self.resources.requests.get("cpu"))
        return max(1, math.ceil(cores)) if cores else 1

    @property
    def cpu_request(self) -> Quantity:
        """The CPU request: the one set, else a core per worker."""
        explicit = self.resources.requests.get("cpu")
        return explicit if explicit is not None else str(self.worker_count)


# ---- KV transfer -------------------------------------------------------------------------------
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


# ---- gateway -----------------------------------------------------------------------------------
class RoutingMode(StrEnum):
    auto = "Auto"
    disaggregated = "Disaggregated"
    aggregated = "Aggregated"


class SloSpec(ApiModel):
    """Latency objectives the gateway routes for (Auto mode) and reports against."""

    ttft_ms: Annotated[int, Field(ge=1)] | None = None
    """Time to first token, milliseconds."""
    itl_ms: Annotated[int, Field(ge=1)] | None = None
    """Inter-token latency, milliseconds."""


class RoutingSpec(ApiModel):
    """How the gateway sends requests."""

    mode: RoutingMode = RoutingMode.auto
    """Auto: per request, prefill on the prefill pool or locally on decode, by SLO and load.
    Disaggregated: always prefill then decode. Aggregated: decode pool only."""


class GatewaySpec(ApiModel):
    """The OpenAI-compatible gateway in front of the pools."""

    replicas: Annotated[int, Field(ge=1, le=100)] = 2
    """Gateway replicas."""
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    """Port of the gateway Service."""
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Type of the gateway Service."""
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    """Routing policy."""
    slo: SloSpec = Field(default_factory=SloSpec)
    """Latency objectives."""
    api_key_secret_ref: SecretKeyRef | None = None
    """Secret key holding the API key clients must send as a Bearer token."""
    resources: ResourceRequirements = Field(
        default_factory=lambda: ResourceRequirements(
            requests={"cpu": "250m", "memory": "256Mi"}, limits={"memory": "1Gi"}
        )
    )
    """CPU and memory of the gateway container."""
    node_selector: LabelMap = Field(default_factory=dict)
    """Node labels the gateway pods require."""
    tolerations: list[PreservedObject] = Field(default_factory=list)
    """Tolerations of the gateway pods."""
    request_log: bool = False
    """Write one JSON line per finished request to the gateway's log (`kubectl logs`): the
    render, prefill and decode pods that served it, their parity hash, timings and token
    counts. Off by default: a line per request costs CPU at high rates."""


# ---- placement ---------------------------------------------------------------------------------
LABEL_KEY = r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
EXTENDED_RESOURCE = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
HOSTNAME_KEY = "kubernetes.io/hostname"


class Strength(StrEnum):
    required = "Required"
    preferred = "Preferred"


class TopologyDomainSpec(ApiModel):
    """Keep every engine pod of a slice (its prefill and decode replicas) inside one topology
    domain: the nodes sharing one value of a node label."""

    topology_key: Annotated[str, Field(pattern=LABEL_KEY, max_length=317)] = "nvidia.com/gpu.clique"
    """Node label whose value names the domain: nvidia.com/gpu.clique (an NVLink domain, as set by
    NVIDIA GPU feature discovery), a rack or zone label, or kubernetes.io/hostname to put the
    prefill and decode of a slice on one node (in-node NVLink/P2P pairs)."""
    mode: Strength = Strength.required
    """Required: a slice's pods wait Pending rather than leave the domain (status condition
    Placement=False says why). Preferred: the scheduler may break the domain when it must."""
    spread_slices: Strength | None = None
    """Put different slices in different domains (pod anti-affinity): Required, Preferred, or
    unset for no spreading."""


class RdmaSpec(ApiModel):
    """RDMA for the KV transfer (NIXL over UCX): the NIC resource, networks and privileges."""

    resource: Annotated[str, Field(pattern=EXTENDED_RESOURCE, max_length=253)]
    """Extended resource of the RDMA device plugin each engine pod requests, e.g.
    rdma/rdma_shared_device_a (k8s-rdma-shared-dev-plugin) or nvidia.com/hostdev."""
    count: Annotated[int, Field(ge=1, le=64)] = 1
    """How many of `resource` each engine pod requests."""
    networks: list[Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        default_factory=list
    )
    """Multus secondary networks (NetworkAttachmentDefinition names, optionally
    namespace/name) attached to engine pods (annotation k8s.v1.cni.cncf.io/networks)."""
    host_network: bool = False
    """Run engine pods in the host network namespace (explicit opt-in: it exposes the engine
    ports on the node and allows one engine pod per node)."""


class PlacementSpec(ApiModel):
    """Where the GPU engine pools (prefill and decode) run; render and gateway pods have their
    own nodeSelector/tolerations."""

    model_config = with_rules(
        [
            rule(
                "!has(self.slices) || self.slices == 1 || has(self.domain)",
                "slices > 1 needs a domain (placement.domain.topologyKey) to keep each slice in",
                ".slices",
            ),
        ]
    )

    node_selector: LabelMap = Field(default_factory=dict)
    """Node labels every engine pod requires (merged with <pool>.nodeSelector)."""
    tolerations: list[PreservedObject] = Field(default_factory=list)
    """Tolerations of every engine pod (added to <pool>.tolerations)."""
    affinity: PreservedObject | None = None
    """Node affinity and pod (anti-)affinity of every engine pod, as in a pod spec; the terms
    pdserve derives from gpuProducts and domain are added to it."""
    accelerator_resource: Annotated[
        str, Field(pattern=r"^([a-z0-9.-]+/[A-Za-z0-9._-]+)?$", max_length=253)
    ] = GPU_RESOURCE
    """Extended resource each engine pod requests tensorParallelSize x dataParallelSize of
    (e.g. amd.com/gpu). Empty: request none (simulator pools in kind or CI)."""
    gpu_products: list[Annotated[str, Field(min_length=1, max_length=63)]] = Field(
        default_factory=list
    )
    """Allowed GPU models (node label nvidia.com/gpu.product, e.g. NVIDIA-H200): engine pods
    require a node with one of them. Empty: any."""
    domain: TopologyDomainSpec | None = None
    """Keep each slice's prefill and decode inside one topology domain. Unset: no co-location."""
    slices: Annotated[int, Field(ge=1, le=64)] = 1
    """Independent groups of prefill.replicas prefill and decode.replicas decode engines, each
    in its own domain and its own StatefulSets (<name>-prefill-s<n>, <name>-decode-s<n>,
    label pdserve.io/slice). Total engines = slices x replicas. Changing it replaces the engine
    StatefulSets."""
    rdma: RdmaSpec | None = None
    """RDMA for the KV transfer: NIC resource, Multus networks, IPC_LOCK, host network opt-in.
    Unset: no RDMA resources or privileges are requested."""
    guaranteed_qos: Annotated[bool | None, Field(alias="guaranteedQoS")] = None
    """Give engine containers requests == limits for CPU and memory (Guaranteed QoS) so the
    kubelet's topology manager can align GPUs and NICs on one NUMA node. Default: on when rdma
    is set. Needs cpu and memory in <pool>.resources."""

    @model_validator(mode="after")
    def _slices_need_a_domain(self) -> PlacementSpec:
        if self.slices > 1 and self.domain is None:
            raise ValueError(
                f"slices is {self.slices} but domain is unset: set "
                "placement.domain.topologyKey (e.g. nvidia.com/gpu.clique) to keep each slice in"
            )
        return self

    @property
    def wants_guaranteed_qos(self) -> bool:
        return self.rdma is not None if self.guaranteed_qos is None else self.guaranteed_qos


# ---- the spec ----------------------------------------------------------------------------------
class DisaggregatedModelSpec(ApiModel):
    """A disaggregated vLLM deployment: prefill and decode GPU pools, a CPU render pool and an
    OpenAI-compatible gateway, kept in parity."""

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

    @model_validator(mode="after")
    def _no_parity_overrides(self) -> DisaggregatedModelSpec:
        pools: list[tuple[str, VllmPoolFields]] = [("decode", self.decode)]
        if self.prefill is not None:
            pools.insert(0, ("prefill", self.prefill))
        pools.append(("render", self.render))
        for name, pool in pools:
            check_extra_args(name, pool.extra_args)
            check_env(name, pool.env)
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
                guaranteed_resources(name, engine.resources)
        self._check_engine_autoscaling()
        return self

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
    def disaggregated(self) -> bool:
        """True when a prefill pool with replicas exists (P/D); False: aggregated on decode."""
        return self.prefill is not None and self.prefill.replicas > 0
