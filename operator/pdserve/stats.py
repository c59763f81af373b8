"""Percentiles and distribution summaries, defined the way `vllm bench serve` computes them
(numpy's default linear interpolation, population standard deviation), so pdserve's numbers
compare with vLLM's."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default); NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * min(100.0, max(0.0, q)) / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: Iterable[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median, std and p<q> of values (NaN when there are none)."""
    data = list(values)
    out = {
        "mean": statistics.fmean(data) if data else math.nan,
        "median": statistics.median(data) if data else math.nan,
        "std": statistics.pstdev(data) if data else math.nan,
    }
    for q in percentiles:
        out[f"p{percentile_word(q)}"] = percentile(data, q)
    return out


def percentile_word(q: float) -> str:
    """50 -> '50', 99.9 -> '99.9' (vLLM's key spelling)."""
    return str(int(q)) if int(q) == q else str(q)
