"""`spec.render`: the CPU render pool."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import Field

from pdserve.api.autoscaling import RenderAutoscalingSpec
from pdserve.api.common import Quantity
from pdserve.api.pools import VllmPoolFields
from pdserve.api.requirements import ResourceRequirements, cpu_cores


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
