"""Summaries as text: one block per run for the terminal, Markdown tables for reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def num(value: Any, digits: int = 3) -> str:
    """A number to `digits` significant digits (no exponent below 1e6); '-' for none."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return "-"
    if value == 0:
        return "0"
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def share(value: Any) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.0%}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def point_name(summary: dict[str, Any]) -> str:
    view = summary["pdserve"]
    if view["rate"] is not None:
        return f"{view['rate']:g} req/s"
    return f"concurrency {view['concurrency']}"


def text_block(summary: dict[str, Any]) -> str:
    """What a finished run prints."""
    view = summary["pdserve"]
    requests = view["requests"]
    unit = "ms" if view["time_scale"] == 1 else "simulated ms"
    lines = [
        f"{summary['label']} at {point_name(summary)}: {requests['measured']} measured "
        f"({requests['warmup_excluded']} warm-up excluded), {requests['completed']} completed, "
        f"{requests['failed']} failed"
        + (f", {requests['cancelled']} cancelled (interrupted)" if view["interrupted"] else "")
        + f"; duration {num(summary['duration'])} s"
        + ("" if view["time_scale"] == 1 else " simulated"),
    ]
    header = (
        f"  {'class':9} {'n':>4}  {'TTFT p50/p95/p99':>22}  {'ITL p50/p95/p99':>20}  "
        f"{'TPOT p50':>8}  {'E2E p50/p95':>16}  {'goodput':>7}   ({unit})"
    )
    lines.append(header)
    for name, stats in view["classes"].items():
        ttft, itl, e2e = stats["ttft_ms"], stats["itl_ms"], stats["e2e_ms"]
        lines.append(
            f"  {name:9} {stats['completed']:>4}  "
            f"{num(ttft['p50']):>6} /{num(ttft['p95']):>6} /{num(ttft['p99']):>6}  "
            f"{num(itl['p50']):>5} /{num(itl['p95']):>5} /{num(itl['p99']):>5}  "
            f"{num(stats['tpot_ms']['p50']):>8}  {num(e2e['p50']):>7} /{num(e2e['p95']):>7}  "
            f"{num(stats['goodput_rps']):>7}"
        )
    documents = view["documents"]
    if documents is not None:
        gateway = ""
        if documents["gateway_queue_nonempty_share"] is not None:
            gateway = (
                f"; gateway queue non-empty {share(documents['gateway_queue_nonempty_share'])}, "
                f"oldest queued {num(documents['gateway_oldest_wait_ms'])} {unit}"
            )
        lines.append(
            f"  documents: {num(view['classes']['document']['input_tokens_per_s'])} input "
            f"tokens/s, waiting for a first token {share(documents['waiting_share'])} of the "
            f"time, oldest wait {num(documents['oldest_wait_ms'])} {unit}{gateway}"
        )
    if view["errors"]["count"]:
        kinds = ", ".join(f"{k}: {v}" for k, v in view["errors"]["kinds"].items())
        lines.append(f"  errors: {kinds}")
    return "\n".join(lines)
