"""`spec.image`: the container images, and vLLM's image names (kept here only: examples, docs
and the chart are tested against them)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field

from pdserve.api.base import ApiModel

# The vLLM release the default images run (docs/operations.md, "Supported vLLM versions").
VLLM_VERSION = "v0.33.0"
# vLLM's own images on Docker Hub, as its release pipeline publishes them: the CUDA build and
# the CPU build (there is no vllm/vllm-cpu).
VLLM_CUDA_REPOSITORY = "vllm/vllm-openai"
VLLM_CPU_REPOSITORY = "vllm/vllm-openai-cpu"
DEFAULT_ENGINE_IMAGE = f"{VLLM_CUDA_REPOSITORY}:{VLLM_VERSION}"
DEFAULT_GATEWAY_IMAGE = "ghcr.io/pdserve/pdserve:0.1.0"

# A vLLM release tag and what may follow it on the CUDA image (a CUDA or OS variant, e.g.
# v0.29.0-cu129): the CPU image is published for the release itself.
_RELEASE_TAG = re.compile(r"^(v\d+\.\d+\.\d+(?:\.post\d+)?)(?:-[A-Za-z0-9_.-]+)?$")


def vllm_cpu_image(engine: str) -> str | None:
    """vLLM's CPU image of the same release as `engine`, when `engine` is vLLM's own CUDA image
    with a release tag (Docker Hub's name, with or without docker.io/); None otherwise (a
    digest, `latest`, or another image: what it was built from cannot be told)."""
    name, _, tag = engine.rpartition(":")
    if "/" in tag or "@" in engine:
        return None
    registry = "docker.io/" if name.startswith("docker.io/") else ""
    release = _RELEASE_TAG.match(tag)
    if name.removeprefix("docker.io/") != VLLM_CUDA_REPOSITORY or release is None:
        return None
    return f"{registry}{VLLM_CPU_REPOSITORY}:{release.group(1)}"


class ImageSpec(ApiModel):
    """Container images."""

    engine: Annotated[str, Field(min_length=1)] = DEFAULT_ENGINE_IMAGE
    """vLLM image for the prefill and decode engines (GPU build)."""
    render: Annotated[str, Field(min_length=1)] | None = None
    """vLLM image for the render pool, which runs on CPU nodes. Default: when engine is vLLM's
    own CUDA image (vllm/vllm-openai:vX.Y.Z), vLLM's CPU image of the same release
    (vllm/vllm-openai-cpu:vX.Y.Z), a fraction of the CUDA image's ~10 GB; otherwise engine."""
    gateway: Annotated[str, Field(min_length=1)] | None = None
    """pdserve gateway image. Default: the operator's own (its --gateway-image, which the chart
    sets to the operator's image), resolved on every reconcile, so an operator upgrade moves
    the gateways of every model that names none (a model created before 0.2 stored the old
    default here: remove the field to follow the operator)."""
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """imagePullPolicy of every container."""
    pull_secrets: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    """Names of image pull Secrets for every pod."""

    @property
    def render_image(self) -> str:
        """The render pool's image: render, else the CPU build of engine, else engine."""
        return self.render or vllm_cpu_image(self.engine) or self.engine
