"""`spec.model.shape`: what sizing needs to know of a model (its parameter count and KV
geometry), given in the spec or found here for well-known models. Values are those of each
model's config.json on the Hugging Face Hub (num_hidden_layers, num_key_value_heads, head_dim or
hidden_size / num_attention_heads, max_position_embeddings) and its model card's size."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pdserve.api.base import ApiModel


class ModelShape(ApiModel):
    """The model's size and KV geometry, for the memory-fit check. Default: looked up by
    model.name for well-known models; unset and unknown: no fit check."""

    parameters_billions: Annotated[float, Field(gt=0, le=100000)]
    """Parameters, in billions (e.g. 70.6)."""
    bytes_per_parameter: Annotated[float, Field(gt=0, le=8)] = 2.0
    """Bytes of one weight as loaded: 2 for bf16/fp16, 1 for fp8, 0.5 for 4-bit."""
    layers: Annotated[int, Field(ge=1, le=10000)]
    """num_hidden_layers."""
    kv_heads: Annotated[int, Field(ge=1, le=10000)]
    """num_key_value_heads."""
    head_dim: Annotated[int, Field(ge=1, le=100000)]
    """head_dim (hidden_size / num_attention_heads when the config has none)."""
    context_length: Annotated[int, Field(ge=1)]
    """max_position_embeddings: vLLM's context length when model.maxModelLen is unset."""
    experts: Annotated[int, Field(ge=0, le=100000)] | None = None
    """Routed experts per MoE layer (n_routed_experts or num_experts); 0: a dense model, which
    expertParallel and nodesPerReplica above 1 are refused for. Unset: not judged."""

    @property
    def dense(self) -> bool:
        return self.experts == 0


def _shape(params: float, layers: int, kv_heads: int, head_dim: int, context: int) -> ModelShape:
    return ModelShape(
        parameters_billions=params,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        context_length=context,
        experts=0,
    )


# Keyed by the lower-cased Hugging Face id; bf16 weights as published; all dense.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "meta-llama/llama-3.1-8b-instruct": _shape(8.03, 32, 8, 128, 131072),
    "meta-llama/llama-3.1-70b-instruct": _shape(70.6, 80, 8, 128, 131072),
    "meta-llama/llama-3.3-70b-instruct": _shape(70.6, 80, 8, 128, 131072),
    "meta-llama/llama-3.1-405b-instruct": _shape(405.9, 126, 8, 128, 131072),
    "qwen/qwen2.5-7b-instruct": _shape(7.62, 28, 4, 128, 32768),
    "qwen/qwen2.5-72b-instruct": _shape(72.7, 80, 8, 128, 32768),
    "qwen/qwen3-0.6b": _shape(0.6, 28, 8, 128, 40960),
    "qwen/qwen3-8b": _shape(8.19, 36, 8, 128, 40960),
    "qwen/qwq-32b": _shape(32.8, 64, 8, 128, 40960),
}


def known_shape(model_name: str) -> ModelShape | None:
    return KNOWN_SHAPES.get(model_name.lower())
