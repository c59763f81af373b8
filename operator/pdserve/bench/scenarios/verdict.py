"""Auto against the better of the other routing modes: requests that met the SLO, and whether
a shortfall is within seed noise."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from pdserve.bench.report import num


def met(summary: dict[str, Any]) -> int:
    """How many measured requests met the SLO."""
    stats = summary["pdserve"]["classes"]["fixed"]
    return round(float(stats["slo_met_share"] or 0) * int(stats["completed"]))


def verdict(autos: Sequence[dict[str, Any]], others: Sequence[Sequence[dict[str, Any]]]) -> str:
    """Auto against the better of the other modes, counted in requests that met the SLO (the
    same planned requests in each, summed over the seeds; goodput in req/s also divides by each
    run's own duration). `autos[i]` and `others[m][i]` ran with the same seed.

    TPOT sits near its limit at these rates, so where each request lands decides its fate and
    any change of placement early on reshuffles which requests meet the SLO: a shortfall within
    two standard errors of the per-seed differences (summed) is reported as seed noise."""
    best_mode = max(others, key=lambda mode: sum(map(met, mode)))
    auto, best = sum(map(met, autos)), sum(map(met, best_mode))
    diffs = [met(a) - met(b) for a, b in zip(autos, best_mode, strict=True)]
    allowance = noise_allowance(diffs)
    if auto >= best:
        text = "yes"
    elif allowance is not None and best - auto <= allowance:
        text = f"within seed noise ({auto - best}; 2 SE {num(allowance)})"
    else:
        text = f"**no** ({auto - best} requests)"
    if len(autos) > 1:
        per_seed = "/".join(f"{d:+d}" for d in diffs)
        text += f" ({auto} vs {best} met; per seed {per_seed})"
    return text


def noise_allowance(diffs: Sequence[int]) -> float | None:
    """Two standard errors of the sum of paired per-seed differences (None with one seed)."""
    if len(diffs) < 2:
        return None
    return 2 * statistics.stdev(diffs) * math.sqrt(len(diffs))
