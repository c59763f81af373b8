"""`pdserve bench overhead`'s figures and report: one point per target and prompt size, the
medians over repeats, the table, the issue's ratios and the chart."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench import plots


@dataclass
class Point:
    """One target at one prompt size, one repeat."""

    target: str
    prompt: str
    c1_p50_ms: float | None = None
    c1_p99_ms: float | None = None
    rps: dict[int, float] = field(default_factory=dict)  # concurrency -> req/s
    per_core: dict[int, float | None] = field(default_factory=dict)  # concurrency -> req/s/core
    stream_tokens_per_core: float | None = None
    stream_tokens_per_s: float | None = None
    half_rate: float | None = None
    half_p50_ms: float | None = None
    half_p99_ms: float | None = None
    cpu_ms_per_request: float | None = None
    rss_mib: float | None = None
    errors: int = 0
    first_error: str | None = None


@dataclass
class Settings:
    seconds: float
    concurrency: list[int]
    stream_tokens: int
    stream_concurrency: int
    max_tokens: int


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def combine(points: Sequence[Point]) -> Point:
    """The median of each figure over the repeats of one target and prompt."""
    first = points[0]
    out = Point(first.target, first.prompt)
    for name in (
        "c1_p50_ms",
        "c1_p99_ms",
        "stream_tokens_per_core",
        "stream_tokens_per_s",
        "half_rate",
        "half_p50_ms",
        "half_p99_ms",
        "cpu_ms_per_request",
        "rss_mib",
    ):
        setattr(out, name, median([getattr(p, name) for p in points]))
    for concurrency in first.rps:
        out.rps[concurrency] = median([p.rps.get(concurrency) for p in points]) or 0.0
        out.per_core[concurrency] = median([p.per_core.get(concurrency) for p in points])
    out.errors = sum(p.errors for p in points)
    out.first_error = next((p.first_error for p in points if p.first_error), None)
    return out


def number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(points: Sequence[Point], settings: Settings) -> str:
    levels = settings.concurrency
    head = ["target", "prompt", "p50 / p99 ms (c=1)"]
    head += [f"req/s per core (c={c})" for c in levels]
    head += [
        f"stream tok/s per core (c={settings.stream_concurrency})",
        "half load: req/s, p50 / p99 ms",
        "CPU ms / req",
        "RSS MiB",
        "errors",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for p in points:
        cells = [p.target, p.prompt, f"{number(p.c1_p50_ms, 2)} / {number(p.c1_p99_ms, 2)}"]
        cells += [
            number(p.per_core.get(c)) if p.per_core.get(c) else f"({number(p.rps.get(c))} req/s)"
            for c in levels
        ]
        cells += [
            number(p.stream_tokens_per_core),
            f"{number(p.half_rate)}: {number(p.half_p50_ms, 2)} / {number(p.half_p99_ms, 2)}",
            number(p.cpu_ms_per_request, 3),
            number(p.rss_mib),
            str(p.errors),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


PDSERVE_TARGETS = {
    "pdserve": "pdserve, OpenAI P/D route",
    "pdserve --data-plane": "pdserve --data-plane, OpenAI P/D route",
}
ROUTER = "vllm-router, P/D"
RENDER_ROUTES = {
    "pdserve-render": "pdserve, render route (render, P/D, derender)",
    "pdserve-dataplane-render": "pdserve --data-plane, render route (render, P/D, derender)",
}
MODES = ("Auto", "Disaggregated")
"""The routing modes the pdserve targets run in: Auto, the default a user gets (P/D or local
prefill per request), or Disaggregated (P/D on every request, what vllm-router does)."""


def labelled(label: str, mode: str) -> str:
    """A pdserve target's label in routing mode `mode` (the labels above are Disaggregated's)."""
    if mode == "Disaggregated":
        return label
    return label.replace("P/D route", f"route, {mode}").replace(
        "(render, P/D,", f"(render, {mode},"
    )


def ratios(points: Sequence[Point], settings: Settings, mode: str = "Disaggregated") -> list[str]:
    """The issue's goals as measured: pdserve (without and with its data plane, in routing mode
    `mode`) against vllm-router, large against small prompts, the render route against
    vllm-router's two hops."""
    by = {(p.target, p.prompt): p for p in points}
    out: list[str] = []

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if not a or not b else f"{a / b:.2f}x"

    prompts = list(dict.fromkeys(p.prompt for p in points))
    for name, ours in PDSERVE_TARGETS.items():
        for prompt in prompts:
            mine, theirs = by.get((labelled(ours, mode), prompt)), by.get((ROUTER, prompt))
            if mine is None or theirs is None:
                continue
            for c in settings.concurrency:
                out.append(
                    f"- {prompt}, c={c}: {name} / vllm-router requests per core = "
                    f"{ratio(mine.per_core.get(c), theirs.per_core.get(c))}"
                )
            out.append(
                f"- {prompt}, streamed: {name} / vllm-router tokens per core = "
                f"{ratio(mine.stream_tokens_per_core, theirs.stream_tokens_per_core)}"
            )
            out.append(
                f"- {prompt}, p99 at half load: {name} {number(mine.half_p99_ms, 2)} ms, "
                f"vllm-router {number(theirs.half_p99_ms, 2)} ms"
            )
        small, large = (
            by.get((labelled(ours, mode), "2KB")),
            by.get((labelled(ours, mode), "200KB")),
        )
        if small and large:
            out.append(
                f"- {name} CPU per request, 200 KB / 2 KB prompt = "
                f"{ratio(large.cpu_ms_per_request, small.cpu_ms_per_request)}"
            )
    for label in RENDER_ROUTES.values():
        for prompt in prompts:
            mine, theirs = by.get((labelled(label, mode), prompt)), by.get((ROUTER, prompt))
            if mine and theirs:
                name = label.split(",")[0]
                out.append(
                    f"- {prompt}: {name} render route / vllm-router CPU per request = "
                    f"{ratio(mine.cpu_ms_per_request, theirs.cpu_ms_per_request)}"
                )
    return out


def chart(points: Sequence[Point], settings: Settings, path: Path) -> str | None:
    """Requests per proxy core at the first concurrency, per target and prompt."""
    c = settings.concurrency[0]
    bars = [(f"{p.target}, {p.prompt}", p.per_core.get(c)) for p in points if p.per_core.get(c)]
    return plots.bar_chart(
        path,
        bars,
        title=f"Requests per proxy core (c={c}, stub engines)",
        ylabel="requests / CPU second",
    )
