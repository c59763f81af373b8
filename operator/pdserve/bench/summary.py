"""Summaries of one run at one rate (or concurrency): tails per request class, goodput against
SLOs, the document stream's throughput and waiting, errors.

The top-level keys are `vllm bench serve --save-result`'s (duration, completed, failed,
request_throughput, request_goodput, mean/median/std/p<q>_{ttft,tpot,itl,e2el}_ms, ttfts, itls,
...), computed the same way over every measured request, so the two tools' JSON compare; the
`pdserve` key holds the per-class view. Warm-up requests are excluded; requests cancelled by
Ctrl-C are counted but not measured."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.bench.records import RequestRecord
from pdserve.bench.runner import QueueSample, RunResult
from pdserve.stats import distribution, percentile_word

PERCENTILES = (50, 95, 99)
SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2e_ms", "e2e": "e2e_ms"}


@dataclass(frozen=True)
class Slo:
    """Per-request limits in milliseconds; a request meets the SLO when it meets every one."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> Slo:
        """'ttft=2000,tpot=30' (also vLLM's 'ttft:2000 tpot:30'); keys ttft, tpot, e2el."""
        if not text:
            return cls()
        values: dict[str, float] = {}
        for item in text.replace(",", " ").split():
            key, sep, value = item.replace(":", "=").partition("=")
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"SLO {item!r}: expected ttft=MS, tpot=MS or e2el=MS")
            try:
                values[SLO_KEYS[key]] = float(value)
            except ValueError:
                raise ValueError(f"SLO {item!r}: {value!r} is not a number of ms") from None
        return cls(**values)

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met(self, record: RequestRecord) -> bool:
        checks = (
            (self.ttft_ms, record.ttft_ms),
            (self.tpot_ms, record.tpot_ms),
            (self.e2e_ms, record.e2e_ms),
        )
        # A one-token answer has no TPOT: nothing to violate (as vLLM counts it).
        return record.ok and all(
            limit is None or value is None or value <= limit for limit, value in checks
        )

    def to_json(self) -> dict[str, float]:
        pairs = (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms), ("e2e_ms", self.e2e_ms))
        return {k: v for k, v in pairs if v is not None}


def _window(records: Sequence[RequestRecord]) -> tuple[float, float]:
    """From the first measured request sent to the last one finished (ms)."""
    start = min(r.sent_at_ms for r in records)
    end = max(r.finished_at_ms or r.sent_at_ms for r in records)
    return start, end


def _covered_share(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Share of [start, end] covered by the union of the intervals."""
    if end <= start:
        return math.nan
    covered, reach = 0.0, start
    for low, high in sorted(intervals):
        low, high = max(low, reach), min(high, end)
        if high > low:
            covered += high - low
            reach = high
    return covered / (end - start)


def _max_concurrent(records: Sequence[RequestRecord]) -> int:
    events = sorted(
        [(r.sent_at_ms, 1) for r in records]
        + [(r.finished_at_ms or r.sent_at_ms, -1) for r in records]
    )
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def _metric_keys(
    prefix: str, values: Iterable[float], percentiles: Sequence[float]
) -> dict[str, float]:
    stats = distribution(values, percentiles)
    return {f"{name}_{prefix}_ms": value for name, value in stats.items()}


def class_stats(
    records: Sequence[RequestRecord], duration_s: float, slo: Slo, percentiles: Sequence[float]
) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    good = [r for r in done if slo.met(r)] if slo.given else []
    groups: dict[str, list[RequestRecord]] = {}
    for record in done:
        groups.setdefault(record.group, []).append(record)
    return {
        "completed": len(done),
        "failed": sum(1 for r in records if r.error is not None),
        "input_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": sum(r.output_tokens for r in done),
        "ttft_ms": distribution((r.ttft_ms for r in done if r.ttft_ms is not None), percentiles),
        "itl_ms": distribution((g for r in done for g in r.inter_token_ms), percentiles),
        "tpot_ms": distribution((r.tpot_ms for r in done if r.tpot_ms is not None), percentiles),
        "e2e_ms": distribution((r.e2e_ms for r in done if r.e2e_ms is not None), percentiles),
        "input_tokens_per_s": sum(r.prompt_tokens for r in done) / duration_s
        if duration_s > 0
        else math.nan,
        "goodput_rps": len(good) / duration_s if slo.given and duration_s > 0 else None,
        "slo_met_share": len(good) / len(done) if slo.given and done else None,
        "groups": {
            name: {
                "completed": len(items),
                "e2e_ms": distribution((r.e2e_ms for r in items if r.e2e_ms is not None), (50, 95)),
                "ttft_ms": distribution(
                    (r.ttft_ms for r in items if r.ttft_ms is not None), (50, 95)
                ),
            }
            for name, items in sorted(groups.items())
        },
    }


def document_view(
    documents: Sequence[RequestRecord],
    samples: Sequence[QueueSample] | None,
    start: float,
    end: float,
) -> dict[str, Any]:
    """The chunked-prefill article's starvation signals for the document stream."""
    waits = [r.ttft_ms for r in documents if r.ttft_ms is not None]
    waiting = [(r.sent_at_ms, r.first_token_at_ms or r.finished_at_ms or end) for r in documents]
    view: dict[str, Any] = {
        "waiting_share": _covered_share(waiting, start, end),
        "oldest_wait_ms": max(waits) if waits else math.nan,
        "gateway_queue_nonempty_share": None,
        "gateway_oldest_wait_ms": None,
    }
    if samples is not None:
        inside = [s for s in samples if start <= s.at_ms <= end]
        if inside:
            view["gateway_queue_nonempty_share"] = sum(1 for s in inside if s.queue > 0) / len(
                inside
            )
            view["gateway_oldest_wait_ms"] = max(s.oldest_wait_ms for s in inside)
    return view


def summarize(
    result: RunResult,
    *,
    label: str,
    model: str,
    endpoint: str = "completions",
    rate: float | None = None,
    concurrency: int | None = None,
    burstiness: float = 1.0,
    time_scale: float = 1.0,
    slo: Slo | None = None,
    workload: str = "",
    percentiles: Sequence[float] = PERCENTILES,
) -> dict[str, Any]:
    slo = slo or Slo()
    measured = [r for r in result.records if not r.warmup and not r.cancelled]
    done = [r for r in measured if r.ok]
    start, end = _window(measured) if measured else (0.0, 0.0)
    duration_s = (end - start) / 1000
    good = [r for r in done if slo.met(r)]
    summary: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if endpoint == "chat" else "openai",
        "endpoint_type": "openai-chat" if endpoint == "chat" else "openai",
        "label": label,
        "model_id": model,
        "tokenizer_id": None,
        "num_prompts": len(measured),
        "request_rate": "inf" if rate is None or math.isinf(rate) else rate,
        "burstiness": burstiness,
        "max_concurrency": concurrency,
        "duration": duration_s,
        "completed": len(done),
        "failed": sum(1 for r in measured if r.error is not None),
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": sum(r.output_tokens for r in done),
        "request_throughput": len(done) / duration_s if duration_s > 0 else math.nan,
        "request_goodput": len(good) / duration_s if slo.given and duration_s > 0 else None,
        "output_throughput": sum(r.output_tokens for r in done) / duration_s
        if duration_s > 0
        else math.nan,
        "total_token_throughput": sum(r.prompt_tokens + r.output_tokens for r in done) / duration_s
        if duration_s > 0
        else math.nan,
        "max_concurrent_requests": _max_concurrent(measured),
        "input_lens": [r.prompt_tokens for r in measured],
        "output_lens": [r.output_tokens for r in measured],
        "ttfts": [(r.ttft_ms or 0.0) / 1000 for r in measured],
        "itls": [[g / 1000 for g in r.inter_token_ms] for r in measured],
        "errors": [r.error or "" for r in measured],
    }
    summary.update(
        _metric_keys("ttft", (r.ttft_ms for r in done if r.ttft_ms is not None), percentiles)
    )
    summary.update(
        _metric_keys("tpot", (r.tpot_ms for r in done if r.tpot_ms is not None), percentiles)
    )
    summary.update(_metric_keys("itl", (g for r in done for g in r.inter_token_ms), percentiles))
    summary.update(
        _metric_keys("e2el", (r.e2e_ms for r in done if r.e2e_ms is not None), percentiles)
    )
    classes: dict[str, list[RequestRecord]] = {}
    for record in measured:
        classes.setdefault(record.request_class, []).append(record)
    errors: dict[str, int] = {}
    for record in measured:
        if record.error is not None:
            kind = record.error.split(":", 1)[0]
            errors[kind] = errors.get(kind, 0) + 1
    summary["pdserve"] = {
        "label": label,
        "workload": workload,
        "rate": rate,
        "concurrency": concurrency,
        "time_scale": time_scale,
        "time_unit": "ms" if time_scale == 1 else f"simulated ms (wall ms / {time_scale:g})",
        "interrupted": result.interrupted,
        "wall_seconds": result.wall_seconds,
        "requests": {
            "planned_or_sent": len(result.records),
            "warmup_excluded": sum(1 for r in result.records if r.warmup and not r.cancelled),
            "cancelled": sum(1 for r in result.records if r.cancelled),
            "measured": len(measured),
            "completed": len(done),
            "failed": summary["failed"],
        },
        "errors": {"count": summary["failed"], "kinds": errors},
        "slo": slo.to_json(),
        "goodput_rps": summary["request_goodput"],
        "gateway_metrics": result.samples is not None,
        "classes": {
            name: class_stats(items, duration_s, slo, percentiles)
            for name, items in sorted(classes.items())
        },
        "documents": document_view(classes["document"], result.samples, start, end)
        if "document" in classes
        else None,
    }
    cleaned: dict[str, Any] = clean(summary)
    return cleaned


def percentile_key(q: float) -> str:
    return f"p{percentile_word(q)}"


def headline_class(summary: dict[str, Any]) -> str | None:
    """The class whose latency a sweep plots: chat in a mix, else the only one."""
    classes = summary["pdserve"]["classes"]
    if "chat" in classes:
        return "chat"
    return next(iter(classes), None)


def compact(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary without the per-request lists (for tables, plots and committed data)."""
    return {
        k: v
        for k, v in summary.items()
        if k not in ("input_lens", "output_lens", "ttfts", "itls", "errors")
    }


def clean(value: Any) -> Any:
    """NaN and infinities become null (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return value
