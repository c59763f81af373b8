"""Reusing measured points: each point's records and summary are kept in the results folder
under a fingerprint of all its parameters, and a rerun of an identical point (same fingerprint,
records present) reads them back instead of measuring again."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.records import read_jsonl, write_jsonl
from pdserve.bench.runner import QueueSample, RunResult
from pdserve.bench.scenarios.points import Point


@dataclass(frozen=True)
class PointFiles:
    summary: Path
    records: Path
    gateway_log: Path
    """Where each request ran, and why (the gateway's request log)."""

    @classmethod
    def of(cls, point: Point, results: Path) -> PointFiles:
        base = point.path(results)
        return cls(
            summary=base.parent / f"{base.name}.json",
            records=base.parent / f"{base.name}.jsonl",
            gateway_log=base.parent / f"{base.name}.gateway.jsonl",
        )


@dataclass
class Measured:
    """What a point's measurement gave: the run, the gateway's counters, its wall seconds."""

    result: RunResult
    counters: dict[str, dict[str, float]]
    seconds: float


def reuse(point: Point, files: PointFiles, *, fresh: bool) -> Measured | None:
    """The point's earlier measurement, when one of this very point is kept (and not fresh)."""
    stored = json.loads(files.summary.read_text()) if files.summary.exists() else None
    if (
        stored is None
        or fresh
        or not files.records.exists()
        or stored["pdserve"].get("fingerprint") != point.fingerprint()
    ):
        return None
    view = stored["pdserve"]
    samples = view.get("queue_samples")
    result = RunResult(
        records=read_jsonl(files.records),
        samples=None if samples is None else [QueueSample(*s) for s in samples],
        wall_seconds=view["wall_seconds"],
    )
    return Measured(result, view["gateway"], view["point_seconds"])


def keep_records(files: PointFiles, result: RunResult) -> None:
    write_jsonl(files.records, result.records)


def keep(files: PointFiles, point: Point, measured: Measured, summary: dict[str, Any]) -> None:
    """Write the point's summary with what a rerun needs to reuse it."""
    result = measured.result
    summary["pdserve"].update(
        fingerprint=point.fingerprint(),
        gateway=measured.counters,
        point_seconds=measured.seconds,
        queue_samples=None
        if result.samples is None
        else [[s.at_ms, s.queue, s.oldest_wait_ms] for s in result.samples],
    )
    files.summary.write_text(json.dumps(summary, indent=1) + "\n")
