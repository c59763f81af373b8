"""Will each engine pool fit the GPUs it may land on? Weights per GPU plus the KV cache of one
full-length sequence, against the memory vLLM may use (--gpu-memory-utilization) on every GPU
product placement allows. vLLM refuses to start when the KV cache left after loading the
weights cannot hold one max_model_len sequence; this says so before any pod is created.

Estimates, not vLLM's profile: weights = parameters x bytes per parameter / tensorParallelSize;
KV per token per GPU = 2 (K and V) x layers x KV heads on the GPU x head dim x KV dtype bytes,
where a GPU holds ceil(KV heads / TP) heads (replicated when TP exceeds them). Activation and
CUDA graph memory come on top: a fit with less than ACTIVATION_RESERVE_GIB to spare is warned
about, not refused."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.api.gpu_products import GpuProduct, lookup
from pdserve.api.model_shape import ModelShape, known_shape
from pdserve.api.serving import KvCacheDtype

if TYPE_CHECKING:
    from pdserve.api.pools import EnginePoolSpec
    from pdserve.api.spec import DisaggregatedModelSpec

GIB = 1024**3
ACTIVATION_RESERVE_GIB = 2.0


@dataclass(frozen=True)
class PoolFit:
    """One engine pool on one GPU product, per GPU."""

    pool: str
    product: GpuProduct
    tensor_parallel_size: int
    budget: float  # bytes vLLM may use
    weights: float
    kv_per_token: float
    context: int  # tokens one sequence may hold (maxModelLen)

    @property
    def kv_needed(self) -> float:
        return self.kv_per_token * self.context

    @property
    def spare(self) -> float:
        return self.budget - self.weights - self.kv_needed

    @property
    def fits(self) -> bool:
        return self.spare >= 0


def shape_of(spec: DisaggregatedModelSpec) -> ModelShape | None:
    return spec.model.shape or known_shape(spec.model.name)


def kv_bytes(spec: DisaggregatedModelSpec) -> float:
    """auto: the model's activation dtype (bf16/fp16) whatever the weights are quantized to."""
    return 2.0 if spec.serving.kv_cache_dtype is KvCacheDtype.auto else 1.0


def pool_fit(
    spec: DisaggregatedModelSpec,
    name: str,
    pool: EnginePoolSpec,
    product: GpuProduct,
    shape: ModelShape,
    tensor_parallel_size: int | None = None,
) -> PoolFit:
    tp = tensor_parallel_size or pool.tensor_parallel_size
    heads = math.ceil(shape.kv_heads / tp)
    return PoolFit(
        pool=name,
        product=product,
        tensor_parallel_size=tp,
        budget=product.memory_bytes * pool.gpu_memory_utilization,
        weights=shape.parameters_billions * 1e9 * shape.bytes_per_parameter / tp,
        kv_per_token=2 * shape.layers * heads * shape.head_dim * kv_bytes(spec),
        context=spec.model.max_model_len or shape.context_length,
    )


def fits(spec: DisaggregatedModelSpec) -> list[PoolFit]:
    """Every engine pool on every known product placement allows (none when the model's shape
    or the products are unknown, or the engines run on CPU)."""
    shape = shape_of(spec)
    if shape is None or spec.placement.engines_on_cpu:
        return []
    products = [p for p in map(lookup, spec.placement.products) if p is not None]
    # Expert parallelism spreads the experts over TP x DP GPUs, which parameters / TP does
    # not model: such pools are not judged rather than wrongly refused.
    return [
        pool_fit(spec, name, pool, product, shape)
        for name, pool in spec.engine_pools()
        if pool.expert_parallel is None
        for product in products
    ]


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _fix(spec: DisaggregatedModelSpec, fit: PoolFit, pool: EnginePoolSpec) -> str:
    shape = shape_of(spec)
    assert shape is not None
    ways = []
    tp = fit.tensor_parallel_size * 2
    while tp <= fit.product.gpus_per_node:
        if pool_fit(spec, fit.pool, pool, fit.product, shape, tp).fits:
            ways.append(f"raise spec.{fit.pool}.tensorParallelSize to {tp}")
            break
        tp *= 2
    room = fit.budget - fit.weights - ACTIVATION_RESERVE_GIB * GIB
    if room > 0:
        tokens = int(room // fit.kv_per_token) // 1024 * 1024
        if tokens >= 1024:
            ways.append(f"lower spec.model.maxModelLen to {tokens} or less")
    ways.append(f"take {fit.product.product} out of spec.placement.gpuProducts")
    return ", or ".join(ways)


def width_problems(spec: DisaggregatedModelSpec) -> list[str]:
    """A pod's GPUs must fit one node: refused for products whose nodes all hold the same
    count (HGX boards, GB200 trays), where no node could ever take the pod."""
    if spec.placement.engines_on_cpu:
        return []
    products = [p for p in map(lookup, spec.placement.products) if p is not None]
    shape = shape_of(spec)
    dense = shape is not None and shape.dense
    problems = []
    for name, pool in spec.engine_pools():
        for product in products:
            if not product.fixed_gpus_per_node or pool.gpus <= product.gpus_per_node:
                continue
            per_node = f" / nodesPerReplica {pool.nodes_per_replica}" if pool.multi_node else ""
            wider = (f"raise spec.{name}.nodesPerReplica for a MoE model, " if not dense
                     else "")  # fmt: skip
            problems.append(
                f"spec.{name}: tensorParallelSize {pool.tensor_parallel_size} x "
                f"dataParallelSize {pool.data_parallel_size}{per_node} = {pool.gpus} GPUs in one "
                f"pod, but every {product.product} node has {product.gpus_per_node} and a pod "
                f"cannot span nodes, so it would stay Pending. Fix: lower "
                f"spec.{name}.tensorParallelSize or dataParallelSize to "
                f"{product.gpus_per_node} GPUs per pod (more replicas instead), {wider}or take "
                f"{product.product} out of spec.placement.gpuProducts"
            )
    return problems


def fit_problems(spec: DisaggregatedModelSpec) -> list[str]:
    """One refusal per pool and product it cannot fit, with the numbers and the fixes: too
    wide for its nodes, or too big for the GPUs' memory."""
    pools = dict(spec.engine_pools())
    problems = width_problems(spec)
    if problems:
        return problems
    for fit in fits(spec):
        if fit.fits:
            continue
        context = "model.maxModelLen" if spec.model.max_model_len else "the model's own context"
        problems.append(
            f"spec.{fit.pool}: {spec.model.name} does not fit {fit.product.product} "
            f"({_gib(fit.product.memory_bytes)}, {_gib(fit.budget)} at "
            f"gpuMemoryUtilization {pools[fit.pool].gpu_memory_utilization:g}): "
            f"{_gib(fit.weights)} of weights per GPU at tensorParallelSize "
            f"{fit.tensor_parallel_size} leave {_gib(max(0.0, fit.budget - fit.weights))} for "
            f"KV, and one {fit.context}-token sequence ({context}) needs {_gib(fit.kv_needed)}; "
            f"vLLM would refuse to start. Fix: {_fix(spec, fit, pools[fit.pool])}"
        )
    return problems


def fit_warnings(spec: DisaggregatedModelSpec) -> list[str]:
    """Fits that leave less than ACTIVATION_RESERVE_GIB per GPU for activations."""
    return [
        f"spec.{fit.pool}: {spec.model.name} on {fit.product.product} leaves "
        f"{_gib(fit.spare)} per GPU after weights and one {fit.context}-token sequence of KV; "
        f"vLLM also needs activation and CUDA graph memory (~{ACTIVATION_RESERVE_GIB:g} GiB) "
        "and may refuse to start: raise tensorParallelSize or lower model.maxModelLen"
        for fit in fits(spec)
        if fit.fits and fit.spare < ACTIVATION_RESERVE_GIB * GIB
    ]


# Headroom over parameters x bytes per parameter: tokenizer, config and the download's
# temporary files beside the safetensors shards.
DOWNLOAD_HEADROOM = 1.2


def hf_cache_gib(spec: DisaggregatedModelSpec) -> int | None:
    """GiB an engine pod's Hugging Face download needs (the emptyDir's sizeLimit and the pod's
    ephemeral-storage request), when the weights come from the Hub into the pod's own emptyDir
    (no source.hf.cache) and the shape is known."""
    shape = shape_of(spec)
    source = spec.model.source
    cached = source.hf is not None and source.hf.cache is not None
    if source.pvc is not None or cached or shape is None:
        return None
    size = shape.parameters_billions * 1e9 * shape.bytes_per_parameter * DOWNLOAD_HEADROOM
    return max(1, math.ceil(size / GIB))
