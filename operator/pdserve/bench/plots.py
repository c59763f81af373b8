"""PNG charts (matplotlib, an optional extra: `pip install 'pdserve[bench]'`). Without
matplotlib every function returns the reason instead of a chart, and the run goes on."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.summary import headline_class

MISSING = "plots skipped: matplotlib is not installed (pip install 'pdserve[bench]')"
COLORS = ("#7b3294", "#1b9e77", "#d95f02", "#1f78b4", "#e7298a", "#66a61e", "#a6761d", "#666666")


def unavailable() -> str | None:
    """Why plots cannot be drawn, or None when they can."""
    return None if importlib.util.find_spec("matplotlib") is not None else MISSING


@dataclass(frozen=True)
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float | None]
    color: int = 0
    dashed: bool = False
    marker: str = "o"


def bar_chart(
    path: Path, bars: Sequence[tuple[str, float | None]], *, title: str, ylabel: str
) -> str | None:
    """One horizontal bar per (label, value) into a small PNG; returns None, or why nothing was
    drawn."""
    if (reason := unavailable()) is not None:
        return reason
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(label, value) for label, value in bars if value is not None]
    figure, axes = plt.subplots(figsize=(7.2, 1.2 + 0.4 * len(shown)), dpi=80)
    try:
        positions = list(range(len(shown)))[::-1]  # the first bar on top
        axes.barh(
            positions,
            [value for _, value in shown],
            color=[COLORS[i % len(COLORS)] for i in range(len(shown))],
        )
        axes.set_yticks(positions, [label for label, _ in shown], fontsize=8)
        figure.suptitle(title, fontsize=10)  # over the whole figure: long labels narrow the axes
        axes.set_xlabel(ylabel)
        axes.grid(axis="x", alpha=0.3)
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path)
    finally:
        plt.close(figure)
    return None


def line_chart(
    path: Path,
    series: Sequence[Series],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    logy: bool = False,
    reference: Sequence[tuple[float, float]] | None = None,
    reference_label: str = "",
) -> str | None:
    """Draw the series into a small PNG; returns None, or why nothing was drawn."""
    if (reason := unavailable()) is not None:
        return reason
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    rows = -(-(len(series) + bool(reference)) // 2)
    figure, axes = plt.subplots(figsize=(6.4, 3.6 + 0.18 * rows), dpi=80)
    try:
        for item in series:
            points = [(x, y) for x, y in zip(item.xs, item.ys, strict=True) if y is not None]
            if not points:
                continue
            axes.plot(
                [x for x, _ in points],
                [y for _, y in points],
                linestyle="--" if item.dashed else "-",
                marker=item.marker,
                markersize=4,
                linewidth=1.6,
                color=COLORS[item.color % len(COLORS)],
                label=item.label,
            )
        if reference:
            axes.plot(
                [x for x, _ in reference],
                [y for _, y in reference],
                linestyle=":",
                color="#999999",
                linewidth=1,
                label=reference_label,
            )
        if logx:
            axes.set_xscale("log", base=2)
        if logy:
            axes.set_yscale("log")
            axes.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axes.yaxis.set_major_formatter(ScalarFormatter())
            axes.yaxis.set_minor_formatter(NullFormatter())
        if logx:
            axes.xaxis.set_major_formatter(ScalarFormatter())
        figure.suptitle(title, fontsize=10)  # over the whole figure: long labels narrow the axes
        axes.set_xlabel(xlabel, fontsize=9)
        axes.set_ylabel(ylabel, fontsize=9)
        axes.tick_params(labelsize=8)
        axes.grid(True, alpha=0.3)
        axes.legend(
            fontsize=7, frameon=False, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14)
        )
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, format="png", pil_kwargs={"optimize": True})
    finally:
        plt.close(figure)
    return None


def _value(summary: dict[str, Any], cls: str, metric: str, stat: str) -> float | None:
    stats = summary["pdserve"]["classes"].get(cls)
    if stats is None:
        return None
    value = stats[metric].get(stat)
    return value if isinstance(value, int | float) else None


def sweep_charts(
    points: Sequence[dict[str, Any]], directory: Path, *, prefix: str = "", unit: str = "ms"
) -> list[str]:
    """ITL (p99 solid, median dashed), TTFT and goodput against offered rate, one color per
    configuration (the summaries' labels); returns the reasons charts were skipped."""
    labels = list(dict.fromkeys(p["label"] for p in points))
    rated = [p for p in points if isinstance(p["pdserve"]["rate"], int | float)]
    if not rated:
        return []
    cls = headline_class(rated[0]) or "fixed"
    itl, ttft, goodput = [], [], []
    for color, label in enumerate(labels):
        mine = sorted(
            (p for p in rated if p["label"] == label), key=lambda p: float(p["pdserve"]["rate"])
        )
        xs = [float(p["pdserve"]["rate"]) for p in mine]
        for stat, dashed in (("p99", False), ("median", True)):
            itl.append(
                Series(
                    f"{label} {stat}",
                    xs,
                    [_value(p, cls, "itl_ms", stat) for p in mine],
                    color,
                    dashed,
                )
            )
            ttft.append(
                Series(
                    f"{label} {stat}",
                    xs,
                    [_value(p, cls, "ttft_ms", stat) for p in mine],
                    color,
                    dashed,
                )
            )
        if any(p["pdserve"]["goodput_rps"] is not None for p in mine):
            goodput.append(Series(label, xs, [p["pdserve"]["goodput_rps"] for p in mine], color))
    rates = sorted({float(p["pdserve"]["rate"]) for p in rated})
    what = f"{cls} requests" if cls not in ("fixed", None) else "requests"
    skipped = [
        line_chart(
            directory / f"{prefix}itl_vs_rate.png",
            itl,
            title=f"Inter-token latency of {what}: p99 (solid), median (dashed)",
            xlabel="offered rate, requests/s",
            ylabel=f"ITL, {unit}",
            logy=True,
        ),
        line_chart(
            directory / f"{prefix}ttft_vs_rate.png",
            ttft,
            title=f"Time to first token of {what}: p99 (solid), median (dashed)",
            xlabel="offered rate, requests/s",
            ylabel=f"TTFT, {unit}",
            logy=True,
        ),
    ]
    if goodput:
        slo = rated[0]["pdserve"]["slo"]
        limits = ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms" for k, v in slo.items())
        skipped.append(
            line_chart(
                directory / f"{prefix}goodput_vs_rate.png",
                goodput,
                title=f"Goodput ({limits})",
                xlabel="offered rate, requests/s",
                ylabel="requests/s meeting the SLO",
                reference=[(r, r) for r in rates],
                reference_label="offered",
            )
        )
    return [reason for reason in skipped if reason]
