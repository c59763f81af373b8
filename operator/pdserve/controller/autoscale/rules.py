"""The raw recommendation of each pool from its signals: pure functions, no clock, no state.
`behaviour.decide` then turns a recommendation into a decision."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

TOLERANCE = 0.1  # as the HPA: no change while the load is within 10% of the target
QUEUE_SHARE_OF_TTFT = 0.5  # queued prompts must drain within half the TTFT SLO


@dataclass(frozen=True)
class Recommendation:
    replicas: int
    reason: str
    signals: dict[str, float] = field(default_factory=dict)


def proportional(current: int, ratio: float) -> int:
    """current x ratio rounded up, unchanged within the tolerance."""
    if abs(ratio - 1.0) <= TOLERANCE:
        return current
    return max(1, math.ceil(current * ratio - 1e-9))


def recommend_render(
    current: int,
    busy: Sequence[float],
    cpu: Sequence[float],
    *,
    workers: int,
    cpu_request: float | None,
    target_busy: float,
    target_cpu: float,
) -> Recommendation | None:
    """`busy` and `cpu`: seconds per second of each render pod with metrics (a pod's busy is the
    higher of the server's and the gateways' view). None: no pod reported."""
    if not busy:
        return None
    per_pod_busy = workers * target_busy
    ratio_busy = sum(busy) / (current * per_pod_busy)
    ratios = {"busy": ratio_busy}
    if cpu and cpu_request:
        ratios["cpu"] = sum(cpu) / (current * cpu_request * target_cpu)
    signal, ratio = max(ratios.items(), key=lambda item: item[1])
    wanted = proportional(current, ratio)
    reason = (
        f"parser busy {sum(busy):.2f} s/s over {len(busy)} pods (target {per_pod_busy:.2f} per pod)"
    )
    if "cpu" in ratios:
        reason += f", CPU {sum(cpu):.2f} cores (target {target_cpu:.0%} of {cpu_request:g})"
    if signal == "cpu" and wanted != current:
        reason += ": CPU asks for more"
    return Recommendation(wanted, reason, {"busy": sum(busy), "cpu": sum(cpu), "ratio": ratio})


def recommend_prefill(
    current: int,
    *,
    token_rate: float,
    queued_tokens: float,
    throughput: float | None,
    ttft_slo: float,
    target: float,
    ttft: float | None = None,
) -> Recommendation | None:
    """`token_rate`: prompt tokens/s the pool prefilled; `queued_tokens`: prompt tokens
    waiting now; `throughput`: prompt tokens one replica prefills per busy second (None: not
    measured yet); `ttft`: mean TTFT the engines measured in the window."""
    if throughput is None or throughput <= 0:
        return None
    budget = ttft_slo * QUEUE_SHARE_OF_TTFT
    need = (token_rate + queued_tokens / budget) / (throughput * target)
    wanted = max(1, math.ceil(need - 1e-9))
    if abs(need / current - 1.0) <= TOLERANCE:
        wanted = current
    reason = (
        f"{token_rate:.0f} prompt tokens/s + {queued_tokens:.0f} queued (to drain in "
        f"{budget:g} s) over {throughput:.0f} tokens/s per replica at {target:.0%}"
    )
    if ttft is not None and ttft > ttft_slo and wanted <= current:
        wanted = current + 1
        reason += f"; TTFT {ttft * 1000:.0f} ms over the SLO {ttft_slo * 1000:.0f} ms"
    return Recommendation(
        wanted,
        reason,
        {"token_rate": token_rate, "queued_tokens": queued_tokens, "throughput": throughput},
    )


def recommend_decode(
    current: int,
    *,
    kv_usage: float | None,
    itl: float | None,
    itl_slo: float | None,
    target_kv: float,
) -> Recommendation | None:
    """`kv_usage`: mean KV-cache use (0-1) of the decode pods; `itl`: mean inter-token latency
    in the window (None: no tokens)."""
    if kv_usage is None:
        return None
    ratios = {"kv": kv_usage / target_kv}
    reason = f"KV cache {kv_usage:.0%} (target {target_kv:.0%})"
    if itl is not None and itl_slo is not None:
        ratios["itl"] = itl / itl_slo
        reason += f", ITL {itl * 1000:.0f} ms (SLO {itl_slo * 1000:.0f} ms)"
    ratio = max(ratios.values())
    signals = {"kv_usage": kv_usage, "ratio": ratio}
    if itl is not None:
        signals["itl"] = itl
    return Recommendation(proportional(current, ratio), reason, signals)


def slices_for(wanted: Mapping[str, int], per_slice: Mapping[str, int]) -> int:
    """Whole slices covering every pool's recommendation."""
    return max(math.ceil(wanted[pool] / per_slice[pool]) for pool in wanted)
