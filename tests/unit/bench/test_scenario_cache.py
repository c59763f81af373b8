"""A scenario point's kept results: reused when the very same point was measured, not when its
fingerprint differs, the records are gone, or --fresh asks to measure again."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.bench.records import RequestRecord
from pdserve.bench.runner import QueueSample, RunResult
from pdserve.bench.scenarios.cache import Measured, PointFiles, keep, keep_records, reuse
from pdserve.bench.scenarios.deployments import AGGREGATED, article_workload
from pdserve.bench.scenarios.points import Point
from pdserve.bench.summary import Slo


def point(rate: float = 1.0) -> Point:
    return Point(AGGREGATED, article_workload(), rate, 4, 1, 0.25, Slo())


def kept(tmp_path: Path) -> tuple[Point, PointFiles]:
    p = point()
    files = PointFiles.of(p, tmp_path)
    record = RequestRecord("bench-fixed-00000", "fixed", "fixed", 8000, 256, 1000.0, 1100.0, 2000.0)
    result = RunResult([record], [QueueSample(1.0, 2.0, 3.0)], wall_seconds=5.0)
    keep_records(files, result)
    summary = {"pdserve": {"wall_seconds": 5.0}}
    keep(files, p, Measured(result, {"routes": {"decode ok": 4.0}}, 7.5), summary)
    return p, files


def test_a_kept_point_is_reused_as_it_was_measured(tmp_path: Path) -> None:
    p, files = kept(tmp_path)
    assert files.summary.name.startswith("aggregated-dp-2-1-")
    assert files.records.name == files.summary.name.replace(".json", ".jsonl")
    stored = json.loads(files.summary.read_text())["pdserve"]
    assert stored["fingerprint"] == p.fingerprint()
    assert stored["queue_samples"] == [[1.0, 2.0, 3.0]]
    measured = reuse(p, files, fresh=False)
    assert measured is not None
    assert measured.counters == {"routes": {"decode ok": 4.0}}
    assert measured.seconds == 7.5
    assert measured.result.wall_seconds == 5.0
    assert measured.result.samples == [QueueSample(1.0, 2.0, 3.0)]
    assert [r.request_id for r in measured.result.records] == ["bench-fixed-00000"]


def test_fresh_another_point_or_missing_records_measure_again(tmp_path: Path) -> None:
    p, files = kept(tmp_path)
    assert reuse(p, files, fresh=True) is None
    other = point(2.0)
    assert reuse(other, files, fresh=False) is None  # same files, another fingerprint
    files.records.unlink()
    assert reuse(p, files, fresh=False) is None
