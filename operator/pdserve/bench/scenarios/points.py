"""A point of a scenario (deployment, workload, rate, seed, ...) and its fingerprint, and the
options of a scenario run."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.scenarios.deployments import Deployment
from pdserve.bench.summary import Slo
from pdserve.bench.workload import Workload


@dataclass(frozen=True)
class Point:
    deployment: Deployment
    workload: Workload
    rate: float
    num_prompts: int
    warmup: int
    time_scale: float
    slo: Slo
    seed: int = 0

    def fingerprint(self) -> dict[str, Any]:
        """Every parameter of the point, as JSON would store it (tuples become lists)."""
        fingerprint: dict[str, Any] = json.loads(json.dumps(self._parameters()))
        return fingerprint

    def _parameters(self) -> dict[str, Any]:
        deployment = asdict(self.deployment)
        for later in ("render", "reversed_engines", "data_plane"):
            if not deployment[later]:
                del deployment[later]  # as before the field existed: those points stay reusable
        return {
            "deployment": deployment,
            "workload": asdict(self.workload),
            "rate": self.rate,
            "num_prompts": self.num_prompts,
            "warmup": self.warmup,
            "time_scale": self.time_scale,
            "slo": self.slo.to_json(),
            "seed": self.seed,
        }

    def path(self, results: Path) -> Path:
        digest = hashlib.sha256(json.dumps(self.fingerprint(), sort_keys=True).encode())
        slug = re.sub(r"[^a-z0-9]+", "-", self.deployment.label.lower()).strip("-")
        return results / f"{slug}-{self.rate:g}-{digest.hexdigest()[:10]}"


@dataclass
class Options:
    results: Path
    docs: Path
    time_scale: float = 0.25
    num_prompts: int | None = None
    rates: tuple[float, ...] | None = None
    seeds: int = 1
    """Each point is measured with seeds 0..seeds-1 (other arrival times and prompts)."""
    data_plane: bool = False
    """Routing mode Auto's deployments behind the gateway's compiled data plane."""
    fresh: bool = False
    progress: bool = True
    reused: int = 0
    measured: int = 0
    point_seconds: float = 0.0


class Interrupted(Exception):
    pass
