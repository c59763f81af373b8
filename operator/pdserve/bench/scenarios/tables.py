"""Table cells and charts of the scenario report, from the points' compact summaries."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.bench import plots
from pdserve.bench.report import num, share
from pdserve.bench.scenarios.points import Options
from pdserve.bench.workload import Workload
from pdserve.sim.experiment import ARTICLE


def stat(summary: dict[str, Any] | None, cls: str, metric: str, name: str) -> float | None:
    if summary is None:
        return None
    stats = summary["pdserve"]["classes"].get(cls)
    value = None if stats is None else stats[metric].get(name)
    return value if isinstance(value, int | float) else None


def pair(summary: dict[str, Any] | None, cls: str, metric: str) -> str:
    return f"{num(stat(summary, cls, metric, 'median'))} / {num(stat(summary, cls, metric, 'p99'))}"


def goodput_cell(summary: dict[str, Any]) -> str:
    stats = summary["pdserve"]["classes"]["fixed"]
    return f"{num(stats['goodput_rps'], 2)} ({share(stats['slo_met_share'])})"


def images(names: Sequence[str], directory: str) -> str:
    return "\n".join(f"![{name}]({directory}/{name})" for name in names)


def chart_dir(options: Options) -> Path:
    return options.docs.parent / options.docs.stem


def sweep_charts(points: list[dict[str, Any]], options: Options, prefix: str) -> list[str]:
    directory = chart_dir(options)
    for reason in set(plots.sweep_charts(points, directory, prefix=prefix, unit="simulated ms")):
        print(reason, file=sys.stderr)
    return sorted(p.name for p in directory.glob(f"{prefix}*.png"))


def article_cell(rate: float, metric: str, side: int) -> str:
    """The article's printed figure, in ms, as 'median / p99' ('-' where it printed none)."""
    p99 = ARTICLE.get((rate, f"p99 {metric} ms"))
    median = ARTICLE.get((rate, f"median {metric} s"))
    left = "-" if median is None else num(median[side] * 1000)
    right = "-" if p99 is None else num(p99[side])
    return "" if median is None and p99 is None else f"{left} / {right}"


def mix_row(summary: dict[str, Any]) -> list[str]:
    view = summary["pdserve"]
    chat, documents = view["classes"].get("chat"), view["classes"].get("document")
    docs = view["documents"] or {}

    def s(cls: dict[str, Any] | None, metric: str, name: str) -> str:
        return "-" if cls is None else num(cls[metric][name])

    return [
        f"{s(chat, 'ttft_ms', 'median')} / {s(chat, 'ttft_ms', 'p99')}",
        f"{s(chat, 'itl_ms', 'median')} / {s(chat, 'itl_ms', 'p95')} / {s(chat, 'itl_ms', 'p99')}",
        f"{s(chat, 'tpot_ms', 'median')} / {s(chat, 'tpot_ms', 'p95')}",
        f"{s(documents, 'e2e_ms', 'median')} / {s(documents, 'e2e_ms', 'p95')}",
        "-" if documents is None else num(documents["input_tokens_per_s"]),
        share(docs.get("waiting_share")),
        num(docs.get("oldest_wait_ms")),
        f"{share(docs.get('gateway_queue_nonempty_share'))} / "
        f"{num(docs.get('gateway_oldest_wait_ms'))}",
        str(view["errors"]["count"]),
    ]


MIX_HEADERS = [
    "chat TTFT p50 / p99",
    "chat ITL p50 / p95 / p99",
    "chat TPOT p50 / p95",
    "document E2E p50 / p95",
    "document input tok/s",
    "documents waiting",
    "oldest document wait",
    "gateway queue non-empty / oldest",
    "errors",
]


def mix_description(workload: Workload, rates: Sequence[float], n: int) -> str:
    at = " and ".join(f"{rate:g}" for rate in rates)
    return (
        f"Collision mix at {at} req/s, {n} measured requests per point (+10 warm-up): "
        f"{workload.describe()}. Documents waiting = share of the time at least one document "
        "had no first token yet (client view); oldest document wait = the longest time to a "
        "document's first token (queue + prefill: the article's starvation signal); the "
        "gateway's queue is its fair-admission queue (empty when nothing is held back)."
    )


def goodput_cells(summaries: Sequence[dict[str, Any]]) -> str:
    """One run's goodput (share), or the mean over seeds (lowest-highest)."""
    if len(summaries) == 1:
        return goodput_cell(summaries[0])
    values = [float(s["pdserve"]["classes"]["fixed"]["goodput_rps"] or 0) for s in summaries]
    mean = sum(values) / len(values)
    return f"{num(mean, 2)} ({num(min(values), 2)}-{num(max(values), 2)})"


def decisions(summary: dict[str, Any]) -> str:
    counts = summary["pdserve"].get("gateway", {}).get("auto_decisions", {})
    return ", ".join(f"{k} {v:g}" for k, v in sorted(counts.items())) or "-"
