"""pdserve bench without a target: the plan a seed gives, what a summary says about known
records, SLO parsing, the JSON Lines record, and charts with and without matplotlib."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench import plots, scenarios
from pdserve.bench.records import RequestRecord, read_jsonl, write_jsonl
from pdserve.bench.report import text_block
from pdserve.bench.runner import QueueSample, RunResult, parse_queue
from pdserve.bench.summary import Slo, summarize
from pdserve.bench.workload import Lengths, collision_mix, fixed, parse_groups, plan
from pdserve.sim.tokenizer import SimTokenizer
from pdserve.stats import percentile


def test_percentile_interpolates_like_numpy_and_vllm_bench() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # order does not matter
    assert percentile(values, 99) == pytest.approx(99.01)  # numpy.percentile(1..100, 99)
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))


def test_the_same_seed_gives_the_same_prompts_at_every_rate_only_stretched() -> None:
    slow = plan(fixed(300, 20), 20, rate=0.5, seed=7, warmup=3)
    fast = plan(fixed(300, 20), 20, rate=2.0, seed=7, warmup=3)
    other = plan(fixed(300, 20), 20, rate=2.0, seed=8)
    assert [r.prompt for r in slow] == [r.prompt for r in fast]
    assert [r.prompt for r in fast] != [r.prompt for r in other]
    assert [r.offset for r in slow] == pytest.approx([4 * r.offset for r in fast])
    assert slow[0].offset == 0
    assert all(b.offset >= a.offset for a, b in itertools.pairwise(fast))
    assert [r.warmup for r in slow] == [True] * 3 + [False] * 17
    assert len({r.request_id for r in slow}) == 20
    closed = plan(fixed(300, 20), 20, rate=None, seed=7)
    assert {r.offset for r in closed} == {0.0}
    assert [r.prompt for r in closed] == [r.prompt for r in slow]


def test_poisson_arrivals_average_the_rate() -> None:
    requests = plan(fixed(10, 2), 2000, rate=4.0, seed=1)
    assert requests[-1].offset / 1999 == pytest.approx(0.25, rel=0.1)


@pytest.mark.parametrize("kind", ["random", "filler"])
def test_prompts_have_the_planned_token_count_and_no_shared_prefix(kind: str) -> None:
    tokenizer = SimTokenizer()
    requests = plan(fixed(500, 8, prompt=kind), 5, rate=1.0, seed=3)  # type: ignore[arg-type]
    for request in requests:
        assert len(tokenizer.encode(request.prompt)) == request.prompt_tokens == 500
    heads = {tuple(tokenizer.encode(r.prompt)[:16]) for r in requests}
    assert len(heads) == 5  # the first cache block differs: no prefix-cache hits between them


def test_the_collision_mix_has_chats_and_a_heavy_tailed_document_stream() -> None:
    requests = plan(collision_mix(chat_share=0.7), 600, rate=3.0, seed=0)
    by_group: dict[str, list[int]] = {}
    for request in requests:
        by_group.setdefault(request.group, []).append(request.prompt_tokens)
    assert set(by_group) == {"chat", "rag", "large"}
    assert len(by_group["chat"]) / 600 == pytest.approx(0.7, abs=0.06)
    assert all(200 <= n <= 600 for n in by_group["chat"])
    assert all(1500 <= n <= 6000 for n in by_group["rag"])
    assert all(12000 <= n <= 30000 for n in by_group["large"])
    documents = sorted(by_group["rag"] + by_group["large"])
    assert documents[-1] > 4 * documents[len(documents) // 2]  # the tail is far from the median
    classes = {r.request_class for r in requests}
    assert classes == {"chat", "document"}


def test_lengths_and_groups_refuse_bad_input() -> None:
    assert Lengths.parse("8000") == Lengths(8000, 8000)
    assert str(Lengths.parse("200-600")) == "200-600"
    with pytest.raises(ValueError, match="LOW-HIGH"):
        Lengths.parse("a-b")
    with pytest.raises(ValueError, match="1 <= low <= high"):
        Lengths.parse("600-200")
    [group] = parse_groups("big:1:10000-20000", Lengths(64, 64))
    assert (group.name, group.input.log, group.request_class) == ("big", True, "document")
    with pytest.raises(ValueError, match="NAME:WEIGHT:LOW-HIGH"):
        parse_groups("big:10000", Lengths(64, 64))


def test_slo_parses_both_spellings_and_refuses_unknown_keys() -> None:
    assert Slo.parse("ttft=2000,tpot=30") == Slo(ttft_ms=2000, tpot_ms=30)
    assert Slo.parse("ttft:2000 tpot:30 e2el:9000") == Slo(2000, 30, 9000)
    assert not Slo.parse("").given
    with pytest.raises(ValueError, match="expected ttft=MS"):
        Slo.parse("itl=50")
    with pytest.raises(ValueError, match="not a number"):
        Slo.parse("ttft=fast")


def record(
    name: str,
    cls: str,
    sent: float,
    first: float | None,
    gaps: list[float],
    *,
    error: str | None = None,
    warmup: bool = False,
    cancelled: bool = False,
    prompt: int = 100,
) -> RequestRecord:
    finished = None if first is None else first + sum(gaps)
    return RequestRecord(
        request_id=name,
        request_class=cls,
        group="large" if cls == "document" else cls,
        prompt_tokens=prompt,
        requested_output_tokens=len(gaps) + 1,
        sent_at_ms=sent,
        first_token_at_ms=first,
        finished_at_ms=finished if error is None else (first or sent) + 5,
        output_tokens=len(gaps) + 1 if first is not None else 0,
        inter_token_ms=gaps,
        error=error,
        warmup=warmup,
        cancelled=cancelled,
    )


RECORDS = [
    record("w", "chat", 0, 500, [10, 10], warmup=True),  # excluded
    record("c1", "chat", 1000, 1100, [20, 20, 20]),  # ttft 100, tpot 20
    record("c2", "chat", 1000, 1400, [40, 40, 40]),  # ttft 400, tpot 40: misses tpot 30
    record("c3", "chat", 2000, None, [], error="HTTP 503: busy"),
    record("d1", "document", 1000, 3000, [10], prompt=8000),  # waits 1000..3000
    record("d2", "document", 2500, 4000, [10], prompt=4000),  # waits 2500..4000
    record("x", "chat", 3000, 3100, [5], cancelled=True),  # Ctrl-C: counted, not measured
]


def test_summary_counts_add_up_and_tails_are_per_class() -> None:
    samples = [QueueSample(1500, 1, 200), QueueSample(2500, 0, 0), QueueSample(3500, 2, 900)]
    result = RunResult(records=RECORDS, samples=samples, interrupted=True, wall_seconds=1.0)
    summary = summarize(result, label="t", model="m", rate=1.0, slo=Slo(ttft_ms=500, tpot_ms=30))
    view = summary["pdserve"]
    requests = view["requests"]
    assert requests == {
        "planned_or_sent": 7,
        "warmup_excluded": 1,
        "cancelled": 1,
        "measured": 5,
        "completed": 4,
        "failed": 1,
    }
    assert requests["completed"] + requests["failed"] == requests["measured"]
    # vLLM's keys, over every measured request
    assert summary["completed"] == 4
    assert summary["failed"] == 1
    assert summary["duration"] == pytest.approx(3.01)  # 1000 ms .. 4010 ms
    assert summary["median_ttft_ms"] == pytest.approx(950)  # 100, 400, 1500, 2000
    assert summary["p99_itl_ms"] == pytest.approx(percentile([20] * 3 + [40] * 3 + [10, 10], 99))
    assert summary["request_goodput"] == pytest.approx(1 / 3.01)  # only c1 meets both limits
    assert summary["errors"] == ["", "", "HTTP 503: busy", "", ""]
    chat = view["classes"]["chat"]
    assert (chat["completed"], chat["failed"]) == (2, 1)
    assert chat["ttft_ms"]["p50"] == pytest.approx(250)
    assert chat["tpot_ms"]["median"] == pytest.approx(30)
    assert chat["slo_met_share"] == pytest.approx(0.5)
    documents = view["classes"]["document"]
    assert documents["input_tokens"] == 12000
    assert documents["input_tokens_per_s"] == pytest.approx(12000 / 3.01)
    assert documents["groups"]["large"]["completed"] == 2
    docs = view["documents"]
    assert docs["waiting_share"] == pytest.approx(3000 / 3010)  # 1000..4000 of 1000..4010
    assert docs["oldest_wait_ms"] == 2000
    assert docs["gateway_queue_nonempty_share"] == pytest.approx(2 / 3)
    assert docs["gateway_oldest_wait_ms"] == 900
    assert view["errors"] == {"count": 1, "kinds": {"HTTP 503": 1}}
    assert view["interrupted"] is True
    json.dumps(summary, allow_nan=False)  # strict JSON: no NaN anywhere
    block = text_block(summary)
    assert "1 cancelled (interrupted)" in block
    assert "errors: HTTP 503: 1" in block


def test_a_run_with_nothing_measured_still_summarizes() -> None:
    result = RunResult(records=[record("a", "chat", 0, None, [], error="refused")], samples=None)
    summary = summarize(result, label="t", model="m", rate=1.0)
    assert summary["completed"] == 0
    assert summary["failed"] == 1
    assert summary["median_ttft_ms"] is None
    assert summary["pdserve"]["documents"] is None
    json.dumps(summary, allow_nan=False)


def test_records_are_the_articles_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_jsonl(path, RECORDS)
    first = json.loads(path.read_text().splitlines()[1])
    for key in ("request_id", "class", "prompt_tokens", "requested_output_tokens", "sent_at_ms",
                "first_token_at_ms", "finished_at_ms", "output_tokens", "inter_token_ms_p95",
                "error"):  # fmt: skip
        assert key in first
    assert first["class"] == "chat"
    assert first["inter_token_ms_p95"] == 20
    assert [r.to_json() for r in read_jsonl(path)] == [r.to_json() for r in RECORDS]


def test_gateway_queue_metrics_are_read_when_present() -> None:
    text = (
        "# TYPE pdserve_gateway_prefill_queue_long gauge\n"
        "pdserve_gateway_prefill_queue_long 3.0\n"
        "pdserve_gateway_prefill_oldest_wait_seconds 1.5\n"
    )
    assert parse_queue(text) == (3.0, 1.5)
    assert parse_queue("vllm:num_requests_waiting 2.0\n") is None


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_charts_are_small_pngs(tmp_path: Path) -> None:
    series = [
        plots.Series("a p99", [0.2, 1, 2], [30, 160, 260]),
        plots.Series("b", [1, 2], [20, None]),
    ]
    assert (
        plots.line_chart(tmp_path / "c.png", series, title="t", xlabel="x", ylabel="y", logy=True)
        is None
    )
    data = (tmp_path / "c.png").read_bytes()
    assert data.startswith(b"\x89PNG")
    assert len(data) < 100_000


def test_without_matplotlib_charts_are_skipped_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda *_: None)
    reason = plots.line_chart(tmp_path / "c.png", [], title="t", xlabel="x", ylabel="y")
    assert reason is not None
    assert "pip install 'pdserve[bench]'" in reason
    assert not (tmp_path / "c.png").exists()


def test_a_sections_reproduce_command_names_seeds_only_where_they_apply() -> None:
    from pdserve.bench.scenarios import section_flags

    flags = ["--seeds", "3", "--docs", "docs/benchmarks.md"]
    assert section_flags(flags, "routing") == flags
    assert section_flags(flags, "article") == ["--docs", "docs/benchmarks.md"]
    assert section_flags(["--seeds=2", "--rates", "1"], "chunked") == ["--rates", "1"]


def routing_point(met_requests: int) -> dict[str, Any]:
    """A routing point's summary as far as the verdict reads it: 60 measured requests."""
    share = met_requests / 60
    return {"pdserve": {"classes": {"fixed": {"slo_met_share": share, "completed": 60}}}}


@pytest.mark.parametrize(
    ("auto", "aggregated", "disaggregated", "expected"),
    [
        ([40, 21, 20], [41, 21, 20], [10, 5, 5], "within seed noise (-1; 2 SE 2) (81 vs 82"),
        ([30, 30, 30], [40, 41, 39], [10, 5, 5], "**no** (-30 requests) (90 vs 120"),
        ([41, 22, 20], [41, 21, 20], [45, 15, 10], "yes (83 vs 82 met; per seed +0/+1/+0)"),
        ([40], [41], [10], "**no** (-1 requests)"),  # one seed: no noise estimate
    ],
)
def test_routing_verdict_allows_only_seed_noise(
    auto: list[int], aggregated: list[int], disaggregated: list[int], expected: str
) -> None:
    def runs(counts: list[int]) -> list[dict[str, Any]]:
        return [routing_point(n) for n in counts]

    text = scenarios.verdict(runs(auto), [runs(aggregated), runs(disaggregated)])
    assert text.startswith(expected)
