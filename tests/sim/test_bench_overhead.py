"""`pdserve bench overhead` as a user runs it: the stub engines and load generator built from
source, the gateway pinned and loaded, and a table with every figure filled in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pdserve.bench.native import native_tools


def test_overhead_measures_the_gateway_with_and_without_its_data_plane(tmp_path: Path) -> None:
    """Both routes (OpenAI engines, and engines behind render servers), each with and without
    the data plane, in routing mode Auto (the default a user gets)."""
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "overhead", "--targets", "pdserve",
         "pdserve-dataplane", "pdserve-render", "pdserve-dataplane-render",
         "--prompts", "2KB", "200KB", "--seconds", "1", "--repeats", "1", "--concurrency", "4",
         "--stream-concurrency", "2", "--stream-tokens", "8", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    points = json.loads((tmp_path / "points.json").read_text())
    gateway = {(p["target"], p["prompt"]): p for p in points if p["target"].startswith("pdserve")}
    assert {prompt for _, prompt in gateway} == {"2KB", "200KB"}
    assert len(gateway) == 8
    for point in gateway.values():
        assert point["errors"] == 0
        assert point["per_core"]["4"] > 0
        assert point["stream_tokens_per_core"] > 0
        assert point["cpu_ms_per_request"] > 0
        assert point["half_p99_ms"] is not None
    direct = [p for p in points if p["target"].startswith("engine direct")]
    assert direct
    assert all(p["per_core"] == {"4": None} for p in direct)  # no proxy to count
    assert all(p["half_rate"] is None for p in direct)
    report = (tmp_path / "overhead.md").read_text()
    assert "pdserve in routing mode Auto" in report
    assert "| pdserve, OpenAI route, Auto | 200KB |" in report
    assert "| pdserve --data-plane, OpenAI route, Auto | 2KB |" in report
    assert "- pdserve CPU per request, 200 KB / 2 KB prompt = " in report
    assert "- pdserve --data-plane CPU per request, 200 KB / 2 KB prompt = " in report
    assert "| pdserve --data-plane, render route (render, Auto, derender) | 200KB |" in report
    assert "- 2KB, c=4: pdserve --data-plane / vllm-router" not in report  # no router here


def test_the_stub_engine_answers_the_pd_handoff_as_vllm_does() -> None:
    """A prefill request (do_remote_decode) gets one token and the params decode pulls from;
    a decode request gets max_tokens, streamed with usage and [DONE]."""
    import httpx

    from pdserve.sim.procs import Processes, free_port

    tools = native_tools()
    with Processes() as procs:
        port = free_port()
        engine = procs.start([str(tools.stub_engine), "-port", str(port), "-role", "prefill"], port)
        body = {"model": "qwen", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        handoff = {"do_remote_decode": True, "do_remote_prefill": False}
        prefill = httpx.post(f"{engine.url}/v1/chat/completions",
                             json={**body, "kv_transfer_params": handoff}).json()  # fmt: skip
        assert prefill["usage"]["completion_tokens"] == 1
        assert prefill["kv_transfer_params"]["do_remote_prefill"] is True
        streamed = httpx.post(
            f"{engine.url}/v1/chat/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        ).text.split("\n\n")
        events = [json.loads(e.removeprefix("data: ")) for e in streamed if e and "[DONE]" not in e]
        assert [e["choices"][0]["delta"]["content"] for e in events[:-1]] == ["tok "] * 5
        assert events[-1]["usage"]["completion_tokens"] == 5
        assert streamed[-2] == "data: [DONE]"
