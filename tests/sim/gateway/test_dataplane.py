"""`pdserve gateway --data-plane`: the compiled data plane in front of the Python gateway, as
processes, over simulated engines that speak OpenAI, or take token ids behind a simulated
render server. What a client sees must not change: the same answers, the same errors in the
same words, fair admission for long prompts, upstream work stopped when the client leaves, and
the gateway and its data plane living and dying together."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.gateway.dataplane import SOURCE, build_binary
from pdserve.gateway.settings import GatewaySettings
from pdserve.sim.procs import Proc, Processes, free_port

MODEL = "qwen"
SIM_MODEL = "Qwen/Qwen3-8B"
FAST = ["--sim-time-scale", "0.01", "--sim-kv-overhead-ms", "0", "--sim-kv-bandwidth-gb-s", "1000"]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6}
ERROR_BODIES = {
    case["name"]: case["body"]
    for case in json.loads((SOURCE / "testdata/error_bodies.json").read_text())
}


@pytest.fixture(scope="module")
def binary() -> Path:
    return build_binary()


@contextmanager
def stack(
    *flags: str,
    mode: str = "Disaggregated",
    engine_flags: list[str] | None = None,
    render: bool = False,
    ranks: int = 1,
) -> Iterator[tuple[Proc, dict[str, Proc]]]:
    """A prefill and a decode engine (with `render`: tokens engines behind a render server;
    with `ranks`, each serving that many data-parallel ranks) and a gateway over them (with
    `flags`): the gateway and the servers by role."""
    extra = [*(engine_flags or FAST), *(["--data-parallel-size", str(ranks)] if ranks > 1 else [])]
    with Processes(startup_timeout=60) as procs:
        engines = {
            role: procs.engine(SIM_MODEL, role=role, served_model_name=MODEL,
                               extra=extra, tokens_only=render)
            for role in ("prefill", "decode")
        }  # fmt: skip
        if render:
            engines["render"] = procs.render(SIM_MODEL, served_model_name=MODEL)
        pool = {"service": "x", "port": 8000}
        config = {
            "model": MODEL, "engineApi": "tokens" if render else "openai",
            "routing": {"mode": mode},
            "pools": {"render": pool if render else None, "prefill": pool, "decode": pool},
            "endpoints": {
                role: [{"url": e.url, **({"dataParallelLocal": ranks} if engine else {})}]
                for role, e in engines.items()
                for engine in [ranks > 1 and role != "render"]
            },
        }  # fmt: skip
        yield procs.gateway(config, *flags), engines


def metric(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    """The sum of a metric's samples on a /metrics page."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
    return sum(float(value) for value in pattern.findall(text))


def eventually(what: str, probe: Callable[[], bool], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.1)


def measured(url: str) -> dict[str, dict[str, float]]:
    """What the gateway's /metrics count of the requests served: by route and outcome, latency
    and first-token observations by route, render calls, render and prefill stages (whoever
    served them; streams' derender calls vary with how chunks merge)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found: dict[str, dict[str, float]] = {}
    series = {
        "requests": r'^pdserve_gateway_requests_total{outcome="([^"]+)",route="([^"]+)"} (\S+)$',
        "e2e": r'^pdserve_gateway_e2e_seconds_count{route="([^"]+)"} (\S+)$',
        "ttft": r'^pdserve_gateway_ttft_seconds_count{route="([^"]+)"} (\S+)$',
        "renderCalls": r'^pdserve_gateway_render_call_seconds_count{render_pod="[^"]+",'
                       r'stage="(render)"} (\S+)$',
        "stages": r'^pdserve_gateway_stage_seconds_count{stage="(render|prefill)"} (\S+)$',
    }  # fmt: skip
    for name, pattern in series.items():
        for *labels, value in re.findall(pattern, text, re.M):
            key = " ".join(labels)
            found.setdefault(name, {})[key] = found.get(name, {}).get(key, 0.0) + float(value)
    return found


def served_by_data_plane(gateway: Proc, route: str = "pd") -> float:
    name = "pdserve_gateway_dataplane_requests_total"
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    found = re.search(rf'^{name}{{route="{route}"}} ([0-9.]+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def answers(url: str) -> list[Any]:
    """A non-streamed chat, a streamed one, and a completion: what a client keeps of each."""
    chat = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).json()
    with httpx.stream("POST", f"{url}/v1/chat/completions",
                      json={**CHAT, "stream": True}, timeout=30) as streamed:  # fmt: skip
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    completion = httpx.post(
        f"{url}/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 4},
        timeout=30,
    ).json()  # fmt: skip
    deltas = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1] if
              json.loads(e)["choices"]]  # fmt: skip
    return [
        chat["choices"][0]["message"]["content"], chat["usage"],
        "".join(d or "" for d in deltas), events[-1],
        completion["choices"][0]["text"], completion["usage"],
    ]  # fmt: skip


def test_the_data_plane_serves_p_d_with_the_answers_of_the_python_gateway(
    tmp_path: Path, binary: Path
) -> None:
    with stack() as (gateway, engines):
        expected = answers(gateway.url)
        counted = measured(gateway.url)
    with stack("--data-plane", str(binary)) as (gateway, engines):
        prefilled = metric(engines["prefill"].url, "vllm:prompt_tokens_total")
        assert answers(gateway.url) == expected
        # Every request went prefill -> decode, and the data plane served all three.
        assert metric(engines["prefill"].url, "vllm:prompt_tokens_total") > prefilled
        eventually("3 requests counted as served by the data plane",
                   lambda: served_by_data_plane(gateway) == 3)  # fmt: skip
        # The gateway's metrics count them as they count the Python gateway's own.
        eventually("the same requests, latencies and first tokens in /metrics",
                   lambda: measured(gateway.url) == counted)  # fmt: skip
        assert counted["requests"] == {"ok openai_pd": 3}
        assert counted["stages"] == {"prefill": 3}
        # Its Go runtime's allocations and collections are in /metrics too.
        eventually("the data plane's allocations in /metrics", lambda: metric(
            gateway.url, "pdserve_gateway_dataplane_allocated_bytes_total") > 0)  # fmt: skip
        for name in ("allocated_objects", "gc_cycles", "gc_cpu_seconds"):
            assert f"pdserve_gateway_dataplane_{name}_total " in httpx.get(
                f"{gateway.url}/metrics", timeout=10).text, name  # fmt: skip


def per_rank(url: str, name: str, ranks: int = 2) -> list[float]:
    """A metric's value per data-parallel rank (its `engine` label) on a /metrics page."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = re.compile(rf'^{re.escape(name)}{{[^}}]*engine="(\d+)"[^}}]*}} ([0-9.e+-]+)$', re.M)
    found: dict[int, float] = {}
    for rank, value in pattern.findall(text):
        found[int(rank)] = found.get(int(rank), 0.0) + float(value)
    return [found.get(rank, 0.0) for rank in range(ranks)]


def test_the_data_plane_serves_p_d_over_data_parallel_ranks(tmp_path: Path, binary: Path) -> None:
    """Engines serving two data-parallel ranks each: the data plane answers as the Python
    gateway does, pinning every hop to one rank (vLLM's header: a rank it keeps a request in
    flight on is not given the next one), never handing a request over."""
    with stack(ranks=2) as (gateway, engines):
        expected = answers(gateway.url)
    # Slow decoding: a stream stays in flight on its decode rank while the next request runs.
    slow = [
        "--sim-time-scale",
        "0.1",
        "--sim-kv-overhead-ms",
        "0",
        "--sim-kv-bandwidth-gb-s",
        "1000",
    ]
    with stack("--data-plane", str(binary), engine_flags=slow, ranks=2) as (gateway, engines):
        assert answers(gateway.url) == expected
        eventually(
            "3 requests served by the data plane", lambda: served_by_data_plane(gateway) == 3
        )
        decode = engines["decode"].url
        before = per_rank(decode, "vllm:request_success_total")
        long = {**CHAT, "stream": True, "max_tokens": 2000, "ignore_eos": True}
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=long,
                          timeout=60) as streamed:  # fmt: skip
            lines = streamed.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"]
            running = per_rank(decode, "vllm:num_requests_running")
            [busy] = [rank for rank, n in enumerate(running) if n]
            answer = httpx.post(f"{gateway.url}/v1/chat/completions", json=CHAT, timeout=60)
            assert answer.status_code == 200, answer.text
            # The stream is still decoding: the request above ran beside it, on the other rank.
            assert next(line for line in lines if line.startswith("data: "))
            done = per_rank(decode, "vllm:request_success_total")
            assert [a - b for a, b in zip(done, before, strict=True)] == [
                1.0 if rank != busy else 0.0 for rank in range(2)
            ]
        eventually(
            "5 requests served by the data plane", lambda: served_by_data_plane(gateway) == 5
        )


RENDERED = [
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "n": 2, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 40, "stop_token_ids": [0, 1, 2, 3]}),
    ("/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 4}),
    ("/v1/completions", {"model": MODEL, "prompt": ["Once"], "max_tokens": 4, "echo": True}),
]


def rendered_answers(url: str) -> list[Any]:
    """Each of RENDERED's answers, as a client keeps it (the gateway's id and the time aside),
    and each of STREAMED's text, finish reasons and usage (how its tokens are grouped into
    chunks depends on timing: derender pipelining)."""
    kept: list[Any] = []
    for path, body in RENDERED:
        answer = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.headers["X-PDServe-Request-Id"] == answer.json()["id"]
        kept.append({k: v for k, v in answer.json().items() if k not in ("id", "created")})
    for path, body in STREAMED:
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=30) as streamed:
            lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        events = [json.loads(line[6:]) for line in lines[:-1]]
        choices = [c for e in events for c in e["choices"]]
        # Choices interleave as they come: each one's text on its own.
        text = {c["index"]: "" for c in choices}
        for c in choices:
            text[c["index"]] += c.get("text") or (c.get("delta") or {}).get("content") or ""
        kept.append((text, [c["finish_reason"] for c in choices if c["finish_reason"]],
                     [e.get("usage") for e in events if e.get("usage")], lines[-1]))  # fmt: skip
    return kept


STREAMED = [
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "n": 2, "max_tokens": 40,
                              "stop_token_ids": [0, 1, 2, 3]}),
    ("/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 4, "stream": True,
                         "stream_options": {"include_usage": True}}),
]  # fmt: skip


@pytest.mark.parametrize("mode", ["Disaggregated", "Aggregated"])
def test_behind_render_servers_the_data_plane_answers_as_the_python_gateway(
    tmp_path: Path, binary: Path, mode: str
) -> None:
    with stack(mode=mode, render=True) as (gateway, engines):
        expected = rendered_answers(gateway.url)
        counted = measured(gateway.url)
    with stack("--data-plane", str(binary), mode=mode, render=True) as (gateway, engines):
        prefilled = metric(engines["prefill"].url, "vllm:prompt_tokens_total")
        assert rendered_answers(gateway.url) == expected
        # Every one of them was served in Go.
        served = len(RENDERED) + len(STREAMED)
        eventually(f"{served} served by the data plane", lambda: (
            served_by_data_plane(gateway, ROUTE[mode]) == served))  # fmt: skip
        # Counted in the gateway's metrics as the Python gateway counts its own, render calls
        # per render server included (the render autoscaler's busy time).
        eventually("the same requests, latencies, first tokens and render calls in /metrics",
                   lambda: measured(gateway.url) == counted)  # fmt: skip
        assert counted["renderCalls"] == {"render": served}
        # A stream asking for log probabilities is refused in the Python gateway's words
        # (streamed chunks are derendered without them), by the data plane: nothing handed over.
        with_logprobs = {**CHAT, "stream": True, "logprobs": True}
        answer = httpx.post(f"{gateway.url}/v1/chat/completions", json=with_logprobs, timeout=30)
        assert (answer.status_code, answer.json()["error"]["param"]) == (400, "logprobs")
        eventually("the refusal counted", lambda: 'outcome="error_400"' in httpx.get(
            f"{gateway.url}/metrics").text)  # fmt: skip
        assert "pdserve_gateway_dataplane_fallbacks_total{" not in httpx.get(
            f"{gateway.url}/metrics").text  # fmt: skip
        went_to_prefill = metric(engines["prefill"].url, "vllm:prompt_tokens_total") > prefilled
        assert went_to_prefill == (mode == "Disaggregated")


ROUTE = {"Disaggregated": "render_pd", "Aggregated": "render_decode"}


def test_what_the_fast_path_cannot_prove_valid_is_judged_by_the_python_gateways_intake(
    tmp_path: Path, binary: Path
) -> None:
    key = {"Authorization": "Bearer k1"}
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    flags = ("--data-plane", str(binary), "--max-tokens-cap", "32", "--api-key-file", str(keys))
    with stack(*flags) as (gateway, _):
        url = f"{gateway.url}/v1/chat/completions"
        refused = httpx.post(url, json=CHAT, timeout=30)
        assert refused.status_code == 401
        assert "missing or invalid API key" in refused.json()["error"]["message"]
        assert httpx.post(url, json=CHAT, headers=key, timeout=30).status_code == 200
        # Answered by the data plane itself, in the shared words (error_bodies.json).
        unknown = httpx.post(url, json={**CHAT, "model": "gpt-4"}, headers=key, timeout=30)
        assert unknown.status_code == 404
        assert unknown.content == ERROR_BODIES["unknown model"].encode()
        broken = httpx.post(url, content=b'{"model": "qwen",', headers=key, timeout=30)
        assert broken.status_code == 400
        assert "not valid JSON" in broken.json()["error"]["message"]
        capped = httpx.post(url, json={**CHAT, "max_tokens": 33}, headers=key, timeout=30)
        assert (capped.status_code, capped.json()["error"]["param"]) == (400, "max_tokens")
        twice = b'{"model": "qwen", "messages": [], "model": "other"}'
        assert httpx.post(url, content=twice, headers=key, timeout=30).status_code == 404
        # Over the body cap, declared or as it arrives (chunked): the 413, from the data plane.
        half = b"x" * (GatewaySettings().max_body_bytes // 2 + 1)
        for oversized in (half * 2, iter([half, half])):
            large = httpx.post(url, content=oversized, headers=key, timeout=30)
            assert (large.status_code, large.json()["error"]["type"]) == (413, "RequestTooLarge")
        # Only the one well-formed, authorized request within the cap was served in Go; the
        # 401 was answered there too, before its body was read, the 413s, the 404 and the cap's
        # 400 once it was read; the broken body and the duplicated key were judged by the
        # Python gateway's intake (the client's key passed on to it) and its answers given by
        # the data plane: nothing was handed over. The 404s and the 400s are counted alike.
        eventually("one request served by the data plane, two judged by the intake", lambda: (
            metric(gateway.url, "pdserve_gateway_dataplane_requests_total", key) == 1
            and metric(gateway.url, "pdserve_gateway_requests_total", key) == 7
        ))  # fmt: skip
        assert metric(gateway.url, "pdserve_gateway_dataplane_fallbacks_total", key) == 0
        counted = httpx.get(f"{gateway.url}/metrics", headers=key, timeout=10).text
        assert 'outcome="error_404",route="unknown"} 2.0' in counted
        assert 'outcome="error_400",route="unknown"} 2.0' in counted
        assert 'outcome="error_413",route="unknown"} 2.0' in counted


def test_a_failed_prefill_falls_back_to_local_prefill_in_the_data_plane(
    tmp_path: Path, binary: Path
) -> None:
    """As the Python gateway would: decode prefills the request itself, the fallback counted
    in the gateway's own series; never handed over (the engines would do its work twice)."""
    with stack("--data-plane", str(binary)) as (gateway, engines):
        engines["prefill"].process.kill()
        engines["prefill"].process.wait()
        answer = httpx.post(f"{gateway.url}/v1/chat/completions", json=CHAT, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
        eventually("the local prefill counted as prefill_failed", lambda: re.search(
            r'pdserve_gateway_fallbacks_total{reason="prefill_failed"} 1.0',
            httpx.get(f"{gateway.url}/metrics").text) is not None)  # fmt: skip
        assert (
            "pdserve_gateway_dataplane_fallbacks_total{"
            not in httpx.get(f"{gateway.url}/metrics").text
        )


def test_in_auto_mode_the_data_plane_decides_each_request_and_auto_learns_from_it(
    tmp_path: Path, binary: Path
) -> None:
    """Routing mode Auto, the default: the data plane decides P/D or local prefill per request
    (dataplane/auto.go) and hands nothing over; what its requests teach (the handoff a stream
    measured, the decisions by reason) reaches the Python gateway's model and metrics."""
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "word " * 1200}]}
    paced = ["--sim-time-scale", "0.2", *FAST[2:]]  # streams long enough to overlap
    with stack("--data-plane", str(binary), mode="Auto", engine_flags=paced) as (gateway, _):
        url = f"{gateway.url}/v1/chat/completions"
        assert httpx.post(url, json=CHAT, timeout=60).status_code == 200  # short: local
        assert httpx.post(url, json=long_chat, timeout=60).status_code == 200  # decode idle
        held = {**long_chat, "stream": True, "max_tokens": 400, "ignore_eos": True}
        with httpx.stream("POST", url, json=held, timeout=60) as running:
            lines = running.iter_lines()
            next(lines)  # decode is busy with this stream (local: decode idle)
            with httpx.stream("POST", url, json={**long_chat, "stream": True}, timeout=60) as pd:
                events = [line for line in pd.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert [line for line in lines if line][-1] == "data: [DONE]"
        decided = r'pdserve_gateway_auto_decisions_total{{reason="{}"}} ([0-9.]+)'
        reasons = ("short_prompt", "decode_idle", "long_prompt")
        got: dict[str, float] = {}

        def folded() -> bool:
            text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
            found = {r: re.search(decided.format(r), text) for r in reasons}
            got.update({r: float(m.group(1)) if m else 0.0 for r, m in found.items()})
            return sum(got.values()) == 4

        eventually("the data plane's 4 Auto decisions in the gateway's metrics", folded)
        # The short prompt is local; the two long ones sent while decode was idle are local too
        # unless the engine's scraped load still showed the one before (the scrape lags up to
        # half a second); the one sent while the held stream ran there goes P/D.
        assert got["short_prompt"] == 1, got
        assert got["long_prompt"] >= 1, got
        disaggregated = served_by_data_plane(gateway, "pd")
        assert disaggregated == got["long_prompt"], got
        assert served_by_data_plane(gateway, "decode") == 4 - disaggregated
        assert "pdserve_gateway_dataplane_fallbacks_total{" not in httpx.get(
            f"{gateway.url}/metrics", timeout=10).text  # fmt: skip
        # The P/D stream's handoff (prefill answered -> decode's first token) taught Auto mode.
        eventually("the handoff learnt", lambda: (httpx.get(f"{gateway.url}/status", timeout=10)
                   .json()["handoffSecondsPerToken"] or 0) > 0)  # fmt: skip
        status = httpx.get(f"{gateway.url}/status", timeout=10).json()
        assert status["dataPlane"]["route"] == "auto", status["dataPlane"]


def test_a_long_prompt_on_the_data_plane_holds_a_fair_admission_slot(
    tmp_path: Path, binary: Path
) -> None:
    slow_prefill = ["--sim-time-scale", "1", "--sim-step-base-ms", "1500",
                    "--sim-kv-overhead-ms", "0"]  # fmt: skip
    with stack("--data-plane", str(binary), engine_flags=slow_prefill) as (gateway, _):
        document = {**CHAT, "max_tokens": 1}
        headers = {"X-PDServe-Class": "document"}

        def admission() -> dict[str, Any]:
            state: dict[str, Any] = httpx.get(f"{gateway.url}/admission").json()
            return state

        with ThreadPoolExecutor(2) as client:
            first = client.submit(
                httpx.post, f"{gateway.url}/v1/chat/completions", json=document,
                headers=headers, timeout=60,
            )  # fmt: skip
            eventually("the document holds a long-prefill slot",
                       lambda: admission()["longInFlight"] == 1)  # fmt: skip
            second = client.submit(
                httpx.post, f"{gateway.url}/v1/chat/completions", json=document,
                headers=headers, timeout=60,
            )  # fmt: skip
            # One prefill replica, one long prefill on it: the second waits in the queue the
            # data plane runs for this replica, as the gateway reports it.
            eventually("the second document queued", lambda: admission()["queued"] == 1)
            assert admission()["longInFlight"] == 1
            assert first.result(timeout=60).status_code == 200
            assert second.result(timeout=60).status_code == 200
        eventually("every slot given back", lambda: admission() == {
            "longInFlight": 0, "queued": 0, "replicas": {}, "heldAt": {}})  # fmt: skip
        eventually("served by the data plane", lambda: served_by_data_plane(gateway) == 2)


def test_gateway_replicas_with_data_planes_admit_long_prompts_through_one_leader(
    tmp_path: Path, binary: Path
) -> None:
    """Two gateway replicas, each behind its data plane, one prefill replica, one long
    prefill at a time on it: the leader's data plane runs the one queue; the follower's data
    plane asks its gateway, which holds the slot through the leader. Documents sent to both at
    once reach prefill one at a time, in the leader's queue."""
    slow_prefill = ["--sim-time-scale", "1", "--sim-step-base-ms", "1500",
                    "--sim-kv-overhead-ms", "0"]  # fmt: skip
    with Processes(startup_timeout=60) as procs:
        engines = {
            role: procs.engine(SIM_MODEL, role=role, served_model_name=MODEL, extra=slow_prefill)
            for role in ("prefill", "decode")
        }  # fmt: skip
        ports = [free_port(), free_port()]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        pool = {"service": "x", "port": 8000}
        peer_key = tmp_path / "peer-key"  # a hold on the leader takes it (as the operator gives)
        peer_key.write_text("the-replicas-peer-key\n")
        gateways = [
            procs.gateway({
                "model": MODEL, "engineApi": "openai", "routing": {"mode": "Disaggregated"},
                "pools": {"render": None, "prefill": pool, "decode": pool},
                "endpoints": {
                    **{role: [{"url": e.url}] for role, e in engines.items()},
                    "peers": [urls[1 - i]], "selfUrl": urls[i],
                },
            }, "--data-plane", str(binary), "--peer-key-file", str(peer_key), port=port)
            for i, port in enumerate(ports)
        ]  # fmt: skip
        leader, follower = sorted(gateways, key=lambda g: g.url)  # the lowest URL leads

        def admission(gateway: Proc) -> dict[str, Any]:
            status: dict[str, Any] = httpx.get(f"{gateway.url}/status").json()["admission"]
            return status

        eventually("the follower's data plane asks through the leader", lambda: admission(
            follower) == {"leader": leader.url, "peers": [leader.url],
                          "dataPlaneAdmits": "through the leader"})  # fmt: skip
        assert admission(leader)["dataPlaneAdmits"] == "here"

        def queue(gateway: Proc) -> dict[str, Any]:
            state: dict[str, Any] = httpx.get(f"{gateway.url}/admission").json()
            return state

        document = {**CHAT, "max_tokens": 1}
        headers = {"X-PDServe-Class": "document"}
        with ThreadPoolExecutor(3) as client:
            url = "{}/v1/chat/completions".format
            sent = [
                client.submit(httpx.post, url(g.url), json=document, headers=headers, timeout=60)
                for g in (follower, leader, follower)
            ]
            eventually("one document prefilling, two queued at the leader", lambda: (
                queue(leader)["longInFlight"], queue(leader)["queued"]) == (1, 2))  # fmt: skip
            assert metric(engines["prefill"].url, "vllm:num_requests_running") <= 1
            assert all(answer.result(timeout=60).status_code == 200 for answer in sent)
        eventually("every slot given back", lambda: queue(leader)["replicas"] == {}
                   and queue(follower)["heldAt"] == {})  # fmt: skip
        assert queue(follower)["longInFlight"] == 0  # the follower decided nothing
        # All three were served by the data planes (none handed over for its slot).
        eventually("served by the data planes", lambda: served_by_data_plane(follower) == 2
                   and served_by_data_plane(leader) == 1)  # fmt: skip


@pytest.mark.parametrize("render", [False, True], ids=["openai", "render"])
def test_a_client_that_leaves_stops_the_decode_engine(
    tmp_path: Path, binary: Path, render: bool
) -> None:
    slow_decode = ["--sim-time-scale", "1", "--sim-kv-overhead-ms", "0"]
    with stack("--data-plane", str(binary), engine_flags=slow_decode, render=render) as (
        gateway, engines,
    ):  # fmt: skip
        decode = engines["decode"].url
        long_stream = {**CHAT, "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=long_stream,
                          timeout=30) as streamed:  # fmt: skip
            lines = streamed.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert metric(decode, "vllm:num_requests_running") == 1
        eventually("decode stopped the stream's request",
                   lambda: metric(decode, "vllm:num_requests_running") == 0)  # fmt: skip
        # Not streamed: the client gives up waiting for the whole answer.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gateway.url}/v1/chat/completions",
                       json={**long_stream, "stream": False}, timeout=2)  # fmt: skip
        eventually("decode stopped the abandoned request",
                   lambda: metric(decode, "vllm:num_requests_running") == 0)  # fmt: skip
        # Both were the data plane's (the one abandoned before its answer is not handed over).
        eventually("the stream counted as served by the data plane", lambda: served_by_data_plane(
            gateway, "render_pd" if render else "pd") >= 1)  # fmt: skip
        assert "pdserve_gateway_dataplane_fallbacks_total{" not in httpx.get(
            f"{gateway.url}/metrics").text  # fmt: skip


def test_the_gateway_and_its_data_plane_stop_together(tmp_path: Path, binary: Path) -> None:
    with stack("--data-plane", str(binary), "--drain-seconds", "0") as (gateway, _):
        children = Path(f"/proc/{gateway.process.pid}/task/{gateway.process.pid}/children")
        (data_plane,) = (int(pid) for pid in children.read_text().split())
        os.kill(data_plane, signal.SIGKILL)
        # Without its data plane nobody can reach the gateway: it stops (and is restarted).
        assert gateway.process.wait(timeout=30) is not None
    with stack("--data-plane", str(binary), "--drain-seconds", "0") as (gateway, _):
        children = Path(f"/proc/{gateway.process.pid}/task/{gateway.process.pid}/children")
        (data_plane,) = (int(pid) for pid in children.read_text().split())
        gateway.process.send_signal(signal.SIGTERM)
        assert gateway.process.wait(timeout=30) == 0
        eventually("the data plane exited", lambda: not Path(f"/proc/{data_plane}").exists()
                   or "Z" in Path(f"/proc/{data_plane}/stat").read_text().split()[2])  # fmt: skip


def test_a_data_plane_binary_that_is_not_there_is_named_with_the_fix(tmp_path: Path) -> None:
    config = tmp_path / "routing.json"
    pool = {"service": "x", "port": 8000}
    config.write_text(json.dumps({
        "model": MODEL, "engineApi": "openai",
        "pools": {"render": None, "prefill": None, "decode": pool},
        "endpoints": {"decode": [{"url": "http://127.0.0.1:9"}]},
    }))  # fmt: skip
    missing = tmp_path / "nowhere" / "dataplane"
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "gateway", "--config", str(config),
         "--data-plane", str(missing)],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"--data-plane {missing}: no such file (or pass `build`)" in done.stderr
