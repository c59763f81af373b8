"""`spec.render`: the CPU render pool."""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated

from pydantic import Field

from pdserve.api.autoscaling import RenderAutoscalingSpec
from pdserve.api.base import CrossFieldRule, with_rules
from pdserve.api.common import Quantity
from pdserve.api.pools import VllmPoolFields
from pdserve.api.requirements import ResourceRequirements, cpu_cores


class EngineApi(StrEnum):
    """What the engines behind a render pool run."""

    scale_out = "ScaleOut"
    tokens_only = "TokensOnly"


def _tokens_only_needs_render(render: RenderSpec) -> str | None:
    if render.engine_api is EngineApi.tokens_only and not render.enabled:
        return (
            "engineApi TokensOnly needs the render pool (enabled: true): without one the engines "
            "speak OpenAI and load a tokenizer; set enabled: true, or drop engineApi"
        )
    return None


TOKENS_ONLY_NEEDS_RENDER = CrossFieldRule(
    "!has(self.engineApi) || self.engineApi != 'TokensOnly' || !has(self.enabled) || self.enabled",
    "engineApi TokensOnly needs enabled: true",
    ".engineApi",
    _tokens_only_needs_render,
)


class RenderSpec(VllmPoolFields):
    """The CPU render pool (`vllm launch render`): chat templates, tokenizing, reasoning and
    tool-call parsing, for both /render and /derender."""

    model_config = with_rules([TOKENS_ONLY_NEEDS_RENDER])

    enabled: bool = True
    """Run a render pool in front of the engines (they then serve vLLM's token-id generate
    API, as engineApi says). false: the engines speak OpenAI themselves."""
    engine_api: EngineApi = EngineApi.scale_out
    """What the engines behind the render pool run. ScaleOut: `vllm serve --enable-scale-out`,
    which loads the tokenizer (the engines get the text parity flags too) and serves every
    request: stop strings, structured outputs (response_format json_schema/json_object,
    structured_outputs) and forced tool calls (tool_choice required or a named function).
    TokensOnly: `vllm serve --tokens-only`, lighter (no tokenizer), which cannot serve those:
    the gateway refuses them with a 400 naming the parameter."""
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
