"""Streamed answers through the gateway: deltas that add up to the whole answer, usage and
[DONE], a tool call arriving whole, a client leaving mid-stream, and the derender pipeline
flushing what it holds when a stream breaks."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve.gateway.settings import GatewaySettings
from tests.support.served_gateway import REQUEST_PATHS
from tests.support.sim_gateway import CHAT, MODEL, PLAIN, Stack, pd_stack, sse_events


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_route1_stream_deltas_add_up_and_end_with_usage_and_done(
    stack: Stack, request_path: str
) -> None:
    client = await pd_stack(stack, data_plane=request_path == "dataplane")
    whole = (await client.post("/v1/chat/completions", json=PLAIN)).json()["choices"][0]["message"]
    events = await sse_events(client, {**PLAIN, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] > 0
    chunks = events[:-2]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0].get("role") == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
    assert "".join(d.get("reasoning") or "" for d in deltas) == whole["reasoning"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    await stack.fold_stats()
    metrics = (await client.get("/metrics")).text
    for stage in ("render", "prefill", "derender", "decode_first_token", "kv_handoff"):
        assert f'pdserve_gateway_stage_seconds_count{{stage="{stage}"}}' in metrics, stage
    # Per render replica (named by its URL in a static list): its calls and their time, the
    # render autoscalers' gateway-side signal; nothing left in flight.
    render_url = stack.gateway_server.endpoints.pools["render"][0].url
    calls = f'pdserve_gateway_render_call_seconds_count{{render_pod="{render_url}",stage='
    derenders = [line for line in metrics.splitlines() if line.startswith(calls + '"derender"}')]
    assert float(derenders[0].split()[-1]) >= 2  # the whole answer, then the stream's calls
    assert calls + '"render"} 2.0' in metrics
    assert f'pdserve_gateway_render_inflight{{render_pod="{render_url}"}} 0.0' in metrics
    # The streamed answer's one choice, derendered in calls of at least one token each.
    assert "pdserve_gateway_derender_calls_per_stream_count 1.0" in metrics
    [stream_calls] = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("pdserve_gateway_tokens_per_derender_call_count ")
    ]
    # The stream's calls, not the whole answer's.
    assert stream_calls == float(derenders[0].split()[-1]) - 1


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_streamed_tool_call_arrives_whole(stack: Stack, request_path: str) -> None:
    client = await pd_stack(stack, data_plane=request_path == "dataplane")
    events = await sse_events(client, CHAT)
    calls = [t for e in events[:-1] for t in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_client_disconnect_aborts_the_engine_work(stack: Stack, request_path: str) -> None:
    client = await pd_stack(stack, data_plane=request_path == "dataplane")
    decode = stack.engines["decode"]
    body = {**PLAIN, "stream": True, "max_tokens": 5000, "ignore_eos": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                break  # the client goes away after the first chunk

    async def idle() -> None:
        while decode.core.running or decode.core.waiting:  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    await asyncio.wait_for(idle(), timeout=10)
    await stack.fold_stats()
    assert "pdserve_gateway_upstream_aborts_total 1.0" in (await client.get("/metrics")).text


async def test_tokens_pending_when_a_stream_breaks_are_flushed_then_the_error() -> None:
    """Regression: tokens merged with the end-of-stream marker used to leave the pipeline
    waiting forever (the client then hung until its own timeout)."""
    from pdserve.gateway.streaming import DerenderPipeline, StreamDerender

    calls: list[Any] = []

    class metrics:
        tokens_per_derender = derender_calls = type(
            "H", (), {"observe": staticmethod(lambda _: None)}
        )

    async def post(body: Any) -> dict[str, Any]:
        calls.append(body)
        return {
            "stream_state": {},
            "chunk": {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]},
        }

    class FakeWriter:
        def note_token(self) -> None: ...

        async def send(self, chunk: Any) -> None: ...

    derender = StreamDerender(
        post=post,
        model=MODEL,
        request_id="r",
        prompt_ids=[1],
        request={},
        chat=True,
        pipelining=GatewaySettings().derender_pipelining,
    )
    pipeline = DerenderPipeline(derender, 0, FakeWriter(), metrics)  # type: ignore[arg-type]
    pipeline.push([5, 6], None)
    pipeline.push([7], None)
    pipeline.queue.put_nowait(([], "__abandoned__", None))  # queued before the pipeline runs
    await asyncio.wait_for(pipeline.task, timeout=5)
    assert [c["generate_chunk"]["choices"][0]["token_ids"] for c in calls] == [[5, 6, 7]]
