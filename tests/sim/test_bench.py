"""`pdserve bench` against the gateway over simulated render + prefill + decode on loopback: the
CI smoke run (a short collision mix sweep), failing targets, Ctrl-C, and a scripted scenario
writing its report section."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.localplane import free_port
from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.app import Gateway
from pdserve.sim.engine_config import EngineConfig
from pdserve.sim.engine_core import SchedulerConfig
from pdserve.sim.render_server import RenderConfig, RenderServer
from tests.support.serving import serving, serving_engine

MODEL = "qwen"
SCALE = 0.05
RECORD_KEYS = {
    "request_id", "class", "prompt_tokens", "requested_output_tokens", "sent_at_ms",
    "first_token_at_ms", "finished_at_ms", "output_tokens", "inter_token_ms_p95", "error",
}  # fmt: skip
# A small collision mix: chats, a RAG group and a large-document group.
MIX = [
    "--workload", "mix", "--chat-input", "20-60", "--chat-output", "8-16",
    "--doc-groups", "rag:0.6:300-600,large:0.4:1000-2000", "--doc-output", "4-8",
]  # fmt: skip


def engine(role: str) -> EngineConfig:
    return EngineConfig(
        model="Qwen/Qwen3-8B",
        served_model_name=MODEL,
        role=role,
        api="tokens",
        scheduler=SchedulerConfig(time_scale=SCALE, enable_prefix_caching=False),
    )


class Upstreams:
    def __init__(self, gateway: str, decode: str) -> None:
        self.gateway, self.decode = gateway, decode


@pytest.fixture
async def pd() -> AsyncIterator[Upstreams]:
    """Render + 1 prefill + 1 decode behind the gateway in Disaggregated mode."""
    render = RenderServer(RenderConfig(model="Qwen/Qwen3-8B", served_model_name=MODEL))
    prefill, decode = engine("prefill"), engine("decode")
    async with (
        serving(render.app()) as render_url,
        serving_engine(prefill) as (_, prefill_url),
        serving_engine(decode) as (_, decode_url),
    ):
        pool = {"service": "x", "port": 8000}
        config = GatewayConfig.model_validate(
            {
                "model": MODEL,
                "engineApi": "tokens",
                "routing": {"mode": "Disaggregated"},
                "pools": {"render": pool, "prefill": pool, "decode": pool},
                "endpoints": {
                    "render": [{"url": render_url}],
                    "prefill": [{"url": prefill_url}],
                    "decode": [{"url": decode_url}],
                },
            }
        )
        async with serving(Gateway(config).app()) as gateway_url:
            yield Upstreams(gateway_url, decode_url)


async def bench(*args: str) -> tuple[int, str, str]:
    """`pdserve bench ARGS` as its own process (the servers above keep serving meanwhile)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.cli", "bench", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_smoke_sweep_over_the_gateway_reports_sane_numbers(
    pd: Upstreams, tmp_path: Path
) -> None:
    code, out, err = await bench(
        "run", "--base-url", pd.gateway, *MIX, "--rate", "4,8", "--num-prompts", "24",
        "--warmup", "4", "--time-scale", str(SCALE), "--slo", "ttft=2000,tpot=100",
        "--label", "pd", "--out", str(tmp_path), "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert "pd at 4 req/s: 20 measured (4 warm-up excluded), 20 completed, 0 failed" in out
    summaries = json.loads((tmp_path / "summary.json").read_text())
    assert [s["pdserve"]["rate"] for s in summaries] == [4, 8]
    for rate in ("4", "8"):
        records = lines(tmp_path / "pd" / f"rate-{rate}.jsonl")
        assert len(records) == 24
        assert sum(r["warmup"] for r in records) == 4
        for r in records:
            assert set(r) >= RECORD_KEYS
            assert r["error"] is None
            assert r["sent_at_ms"] <= r["first_token_at_ms"] <= r["finished_at_ms"]
            assert r["output_tokens"] == r["requested_output_tokens"]  # ignore_eos honoured
            # one gap per chunk; under load the gateway merges tokens into fewer chunks
            assert 0 < len(r["inter_token_ms"]) <= r["output_tokens"] - 1
        assert {r["class"] for r in records} == {"chat", "document"}
        summary = json.loads((tmp_path / "pd" / f"rate-{rate}.json").read_text())
        # vLLM bench's keys, and counts that add up
        assert summary["completed"] + summary["failed"] == summary["num_prompts"] == 20
        assert summary["total_input_tokens"] == sum(
            r["prompt_tokens"] for r in records if not r["warmup"]
        )
        assert 0 < summary["median_ttft_ms"] <= summary["p99_ttft_ms"]
        assert summary["median_ttft_ms"] <= summary["median_e2el_ms"]
        assert 0 < summary["median_itl_ms"] <= summary["p99_itl_ms"]
        assert summary["request_goodput"] <= summary["request_throughput"]
        view = summary["pdserve"]
        assert view["time_unit"] == "simulated ms (wall ms / 0.05)"
        chat, documents = view["classes"]["chat"], view["classes"]["document"]
        assert chat["completed"] + documents["completed"] == 20
        assert chat["ttft_ms"]["p50"] <= chat["ttft_ms"]["p95"] <= chat["ttft_ms"]["p99"]
        assert chat["ttft_ms"]["p99"] <= chat["e2e_ms"]["p99"]
        assert set(documents["groups"]) <= {"rag", "large"}
        assert documents["input_tokens_per_s"] > 0
        docs = view["documents"]
        assert 0 < docs["waiting_share"] <= 1
        assert view["gateway_metrics"] is True  # the document queue was read from the gateway
    for chart in ("itl_vs_rate.png", "ttft_vs_rate.png", "goodput_vs_rate.png"):
        assert (tmp_path / chart).stat().st_size > 1000


async def test_target_errors_are_counted_never_fatal(pd: Upstreams, tmp_path: Path) -> None:
    async with httpx.AsyncClient() as client:
        await client.post(f"{pd.decode}/sim/faults", json={"http_5xx": 3})
    code, out, err = await bench(
        "run", "--base-url", pd.gateway, "--model", MODEL, "--input-len", "50",
        "--output-len", "8", "--rate", "20", "--num-prompts", "10", "--time-scale", str(SCALE),
        "--out", str(tmp_path), "--no-progress", "--no-plots",
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "rate-20.json").read_text())
    assert (summary["completed"], summary["failed"]) == (7, 3)
    assert summary["pdserve"]["errors"]["kinds"] == {"HTTP 502": 3}
    failed = [r for r in lines(tmp_path / "run" / "rate-20.jsonl") if r["error"]]
    assert all("injected engine failure" in r["error"] for r in failed)
    assert "errors: HTTP 502: 3" in out


async def test_an_unreachable_target_is_reported_not_raised(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    code, _, err = await bench(
        "run", "--base-url", dead, "--model", "m", "--num-prompts", "5", "--rate", "50",
        "--out", str(tmp_path), "--no-progress", "--no-plots",
    )  # fmt: skip
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "rate-50.json").read_text())
    assert (summary["completed"], summary["failed"]) == (0, 5)
    assert set(summary["pdserve"]["errors"]["kinds"]) == {"ConnectError"}


async def test_ctrl_c_writes_what_was_measured(pd: Upstreams, tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.cli", "bench", "run", "--base-url", pd.gateway,
        "--model", MODEL, "--input-len", "50", "--output-len", "6000", "--rate", "50",
        "--num-prompts", "4", "--time-scale", str(SCALE), "--out", str(tmp_path),
        "--no-progress", "--no-plots",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient() as client:
            deadline = time.monotonic() + 30
            while (
                "pdserve_gateway_inflight_requests 4.0"
                not in (await client.get(f"{pd.gateway}/metrics")).text
            ):
                assert time.monotonic() < deadline, "the bench never had its requests in flight"
                await asyncio.sleep(0.05)
        process.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 130, err.decode()
    assert "interrupted: writing what was measured" in err.decode()
    summary = json.loads((tmp_path / "run" / "rate-50.json").read_text())
    assert summary["pdserve"]["interrupted"] is True
    assert summary["pdserve"]["requests"]["cancelled"] == 4
    records = lines(tmp_path / "run" / "rate-50.jsonl")
    assert [r["cancelled"] for r in records] == [True] * 4
    assert "cancelled (interrupted)" in out.decode()


async def test_scenario_writes_its_report_section_and_reuses_points(tmp_path: Path) -> None:
    report = tmp_path / "docs" / "benchmarks.md"
    report.parent.mkdir()
    report.write_text(
        "# Benchmarks\n\nHand-written intro.\n\n<!-- bench:article -->\nstale\n"
        "<!-- /bench:article -->\n\nHand-written analysis.\n"
    )
    args = (
        "scenario", "article", "--rates", "4", "--num-prompts", "3", "--time-scale", "0.05",
        "--results", str(tmp_path / "results"), "--docs", str(report), "--no-progress",
    )  # fmt: skip
    code, _, err = await bench(*args)
    assert code == 0, err
    assert "article: 3 points measured, 0 reused" in err
    text = report.read_text()
    assert text.startswith("# Benchmarks\n\nHand-written intro.\n")
    assert text.endswith("<!-- /bench:article -->\n\nHand-written analysis.\n")
    assert "stale" not in text
    assert "Reproduce: `pdserve bench scenario article --rates 4 --num-prompts 3" in text
    row = next(line for line in text.splitlines() if line.startswith("| 4 | "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    for cell in cells[1:4]:  # median / p99 ITL of the three deployments, simulated ms
        median, p99 = (float(v) for v in cell.split(" / "))
        assert 0 < median <= p99
    assert (report.parent / "benchmarks" / "article_itl_vs_rate.png").exists()
    code, _, err = await bench(*args)
    assert code == 0, err
    assert "article: 0 points measured, 3 reused" in err
    assert report.read_text().count("<!-- bench:article -->") == 1


async def test_a_plain_engine_is_a_target_too_chat_and_closed_loop(tmp_path: Path) -> None:
    """No gateway: the model comes from /v1/models, there is no document queue to read, and a
    fixed concurrency replaces the rate."""
    config = replace(engine("both"), api="openai")
    async with serving_engine(config) as (_, url):
        code, out, err = await bench(
            "run", "--base-url", url, *MIX, "--endpoint", "chat", "--concurrency", "1,4",
            "--num-prompts", "12", "--time-scale", str(SCALE), "--out", str(tmp_path),
            "--no-progress", "--no-plots",
        )  # fmt: skip
    assert code == 0, err
    for concurrency in (1, 4):
        summary = json.loads((tmp_path / "run" / f"concurrency-{concurrency}.json").read_text())
        assert summary["model_id"] == MODEL
        assert summary["backend"] == "openai-chat"
        assert summary["max_concurrency"] == concurrency
        assert summary["max_concurrent_requests"] <= concurrency
        assert (summary["completed"], summary["failed"]) == (12, 0)
        documents = summary["pdserve"]["documents"]
        assert documents["gateway_queue_nonempty_share"] is None
        assert documents["waiting_share"] is not None
    assert "run at concurrency 4: 12 measured" in out


def test_a_scenario_deployment_with_a_render_pool_routes_by_exact_token_counts(
    tmp_path: Path,
) -> None:
    """A render server in front of token-id engines: the gateway renders every request (the
    render_pd route), and the point's fingerprint says so (points without one stay as they
    were, so earlier results remain reusable)."""
    from dataclasses import replace

    from pdserve.bench.scenarios import AUTO_FAST, Options, Point, mix_workload, run_point
    from pdserve.bench.summary import Slo

    deployment = replace(AUTO_FAST, label="auto with render", render=True)
    point = Point(deployment, mix_workload(), 20.0, 6, 1, 0.05, Slo())
    options = Options(results=tmp_path, docs=tmp_path / "b.md", progress=False)
    summary = run_point(point, options)
    assert summary["pdserve"]["errors"]["count"] == 0
    routes = summary["pdserve"]["gateway"]["routes"]
    assert routes.get("render ok", 0) + routes.get("render_pd ok", 0) == 6
    # Next to the point: where each request ran and why, as the gateway logged it.
    [gateway_log] = tmp_path.glob("*.gateway.jsonl")
    logged = [json.loads(line) for line in gateway_log.read_text().splitlines()]
    assert len(logged) == 6  # every request, the warm-up one included
    assert all(entry["decode_engine"] and entry["auto_reason"] for entry in logged)
    for entry in logged:
        assert (entry["route"] == "render_pd") == (entry["prefill_engine"] is not None)
    assert point.fingerprint()["deployment"]["render"] is True
    assert (
        "render"
        not in Point(AUTO_FAST, mix_workload(), 20.0, 6, 1, 0.05, Slo()).fingerprint()["deployment"]
    )
