"""`spec.image`: the container images."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pdserve.api.base import ApiModel

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
