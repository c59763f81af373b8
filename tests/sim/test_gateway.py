"""The gateway over simulated render servers and engines on loopback: every route, streaming,
failures injected through the simulators, parity gating, bad input, auth, limits."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from aiohttp import web

from devtools.localplane import free_port
from pdserve.contract.routing import GatewayConfig
from pdserve.controller.health import HealthVerdict, TransportMonitor
from pdserve.gateway.app import Gateway
from pdserve.gateway.endpoints import Endpoint
from pdserve.gateway.policy import AutoPolicy, PolicySettings
from pdserve.gateway.settings import GatewaySettings
from pdserve.sim.engine_config import EngineConfig, TransferConfig
from pdserve.sim.engine_core import SchedulerConfig
from pdserve.sim.engine_server import EngineServer
from pdserve.sim.generation import ModelBehaviour
from pdserve.sim.render_server import RenderConfig, RenderServer
from tests.support.serving import serving

MODEL = "qwen"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "weather in Paris?"}],
    "tools": TOOLS,
    "tool_choice": "auto",
    "max_tokens": 200,
}
PLAIN: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "tell me a story"}],
    "max_tokens": 200,
}
RENDER = RenderConfig(
    model="Qwen/Qwen3-8B",
    served_model_name=MODEL,
    reasoning_parser="qwen3",
    tool_call_parser="hermes",
    enable_auto_tool_choice=True,
)


def engine(role: str, *, api: str = "tokens", policy: str = "fail") -> EngineConfig:
    return EngineConfig(
        model="Qwen/Qwen3-8B",
        served_model_name=MODEL,
        role=role,
        api=api,
        port=free_port(),
        scheduler=SchedulerConfig(time_scale=0.01),
        transfer=TransferConfig(load_failure_policy=policy),
        behaviour=ModelBehaviour(reasoning=True),
        render=RENDER,
    )


class Stack:
    """Simulators plus a gateway, all on loopback ports."""

    def __init__(self, exits: AsyncExitStack) -> None:
        self.exits = exits
        self.engines: dict[str, EngineServer] = {}
        self.renders: list[RenderServer] = []

    async def start(self, server: Any, port: int | None = None) -> str:
        return await self.exits.enter_async_context(serving(server.app(), port=port))

    async def engine(self, name: str, config: EngineConfig) -> str:
        server = EngineServer(config)
        self.engines[name] = server
        return await self.start(server, config.port)

    async def render(self, config: RenderConfig = RENDER) -> str:
        server = RenderServer(config)
        self.renders.append(server)
        return await self.start(server)

    async def gateway(self, config: dict[str, Any], **settings: Any) -> httpx.AsyncClient:
        gateway = Gateway(GatewayConfig.model_validate(config), GatewaySettings(**settings))
        self.gateway_server = gateway
        url = await self.start(gateway)
        return await self.exits.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    async with AsyncExitStack() as exits:
        yield Stack(exits)


def routing(
    engine_api: str = "tokens",
    *,
    prefill: bool = True,
    render: bool = True,
    mode: str = "Disaggregated",
    slo: dict[str, int] | None = None,
    endpoints: dict[str, Any] | None = None,
) -> dict[str, Any]:
    pool = {"service": "x", "port": 8000}
    return {
        "model": MODEL,
        "engineApi": engine_api,
        "parityHash": "p1",
        "routing": {"mode": mode, "slo": slo or {}},
        "pools": {
            "render": pool if render else None,
            "prefill": pool if prefill else None,
            "decode": pool,
        },
        "endpoints": endpoints or {},
    }


def ep(url: str, parity: str | None = "p1") -> dict[str, Any]:
    return {"url": url, "parityHash": parity}


async def pd_stack(
    stack: Stack,
    *,
    prefill_config: EngineConfig | None = None,
    decode_config: EngineConfig | None = None,
    mode: str = "Disaggregated",
    slo: dict[str, int] | None = None,
    policy: str = "fail",
    kv_transfer: dict[str, Any] | None = None,
    **gateway_settings: Any,
) -> httpx.AsyncClient:
    """A render server, a prefill and a decode engine, and a gateway over them."""
    render = await stack.render()
    prefill = await stack.engine("prefill", prefill_config or engine("prefill"))
    decode = await stack.engine("decode", decode_config or engine("decode", policy=policy))
    endpoints = {"render": [ep(render)], "prefill": [ep(prefill)], "decode": [ep(decode)]}
    config = routing(mode=mode, slo=slo, endpoints=endpoints)
    if kv_transfer is not None:
        config["kvTransfer"] = kv_transfer
    return await stack.gateway(config, **gateway_settings)


async def sse_events(client: httpx.AsyncClient, body: dict[str, Any]) -> list[Any]:
    async with client.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True}
    ) as response:
        assert response.status_code == 200, await response.aread()
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    return [
        line.removeprefix("data: ")
        if line == "data: [DONE]"
        else json.loads(line.removeprefix("data: "))
        for line in lines
    ]


async def test_route1_pd_non_stream_splits_reasoning_and_tool_calls(stack: Stack) -> None:
    client = await pd_stack(stack)
    answer = (await client.post("/v1/chat/completions", json=CHAT)).json()
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert answer["model"] == MODEL
    assert stack.engines["decode"].core.prefix_queries == 0  # decode pulled KV, did not prefill


async def test_answers_match_the_aggregated_path_token_for_token(stack: Stack) -> None:
    client = await pd_stack(stack)
    render = await stack.render()
    aggregated = await stack.engine("both", engine("both"))
    other = await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(render)], "decode": [ep(aggregated)]})
    )
    pd = (await client.post("/v1/chat/completions", json=PLAIN)).json()
    local = (await other.post("/v1/chat/completions", json=PLAIN)).json()
    assert pd["choices"][0]["message"] == local["choices"][0]["message"]
    assert pd["usage"] == local["usage"]


async def test_route1_stream_deltas_add_up_and_end_with_usage_and_done(stack: Stack) -> None:
    client = await pd_stack(stack)
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


async def test_streamed_tool_call_arrives_whole(stack: Stack) -> None:
    client = await pd_stack(stack)
    events = await sse_events(client, CHAT)
    calls = [t for e in events[:-1] for t in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


async def test_route3_render_and_one_pool(stack: Stack) -> None:
    render = await stack.render()
    decode = await stack.engine("both", engine("both"))
    client = await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(render)], "decode": [ep(decode)]})
    )
    answer = (await client.post("/v1/chat/completions", json=CHAT)).json()
    assert answer["choices"][0]["message"]["tool_calls"]
    events = await sse_events(client, PLAIN)
    assert events[-1] == "[DONE]"


async def test_route2_openai_pd_and_route4_aggregated(stack: Stack) -> None:
    prefill = await stack.engine("prefill", engine("prefill", api="openai"))
    decode = await stack.engine("decode", engine("decode", api="openai"))
    client = await stack.gateway(
        routing(
            "openai", render=False, endpoints={"prefill": [ep(prefill)], "decode": [ep(decode)]}
        )
    )
    answer = (await client.post("/v1/chat/completions", json=CHAT)).json()
    assert answer["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "kv_transfer_params" not in answer
    assert stack.engines["decode"].core.prefix_queries == 0
    events = await sse_events(client, PLAIN)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    # The streamed P/D request taught Auto mode this KV path's handoff time.
    assert (await client.get("/status")).json()["handoffSecondsPerToken"] > 0

    aggregated = await stack.gateway(
        routing(
            "openai",
            render=False,
            mode="Aggregated",
            endpoints={"prefill": [ep(prefill)], "decode": [ep(decode)]},
        )
    )
    before = stack.engines["decode"].core.prefix_queries
    assert (await aggregated.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert stack.engines["decode"].core.prefix_queries > before  # prefilled on decode itself


@pytest.mark.parametrize("policy", ["fail", "recompute"])
async def test_failed_kv_transfer_still_answers(stack: Stack, policy: str) -> None:
    client = await pd_stack(stack, policy=policy)
    await httpx.AsyncClient().post(
        f"http://127.0.0.1:{stack.engines['decode'].config.port}/sim/faults",
        json={"fail_transfers": 2},
    )
    for body in (PLAIN, {**PLAIN, "stream": True}):
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
    metrics = (await client.get("/metrics")).text
    if policy == "fail":
        assert 'pdserve_gateway_fallbacks_total{reason="kv_load_failed"} 2.0' in metrics


async def test_prefill_down_falls_back_to_local_prefill(stack: Stack) -> None:
    render = await stack.render()
    decode = await stack.engine("decode", engine("both"))
    dead = f"http://127.0.0.1:{free_port()}"
    client = await stack.gateway(
        routing(endpoints={"render": [ep(render)], "prefill": [ep(dead)], "decode": [ep(decode)]})
    )
    assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert 'reason="prefill_failed"' in (await client.get("/metrics")).text


async def test_render_replica_down_is_retried_on_another(stack: Stack) -> None:
    render = await stack.render()
    decode = await stack.engine("both", engine("both"))
    dead = f"http://127.0.0.1:{free_port()}"
    client = await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(dead), ep(render)], "decode": [ep(decode)]})
    )
    for _ in range(2):
        assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200


async def test_decode_crash_mid_stream_gives_an_error_event_and_done(stack: Stack) -> None:
    client = await pd_stack(stack)
    decode_port = stack.engines["decode"].config.port
    await httpx.AsyncClient().post(
        f"http://127.0.0.1:{decode_port}/sim/faults", json={"drop_stream_after": 3}
    )
    events = await sse_events(client, {**PLAIN, "max_tokens": 100})
    assert events[-1] == "[DONE]"
    assert "error" in events[-2]
    assert "ended before the answer was complete" in events[-2]["error"]["message"]


async def test_client_disconnect_aborts_the_engine_work(stack: Stack) -> None:
    client = await pd_stack(stack)
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
    assert "pdserve_gateway_upstream_aborts_total 1.0" in (await client.get("/metrics")).text


async def test_parity_gating_never_mixes_templates(stack: Stack) -> None:
    render_a = await stack.render()
    render_b = await stack.render()
    decode = await stack.engine("both", engine("both"))
    only_b = await stack.gateway(
        routing(
            prefill=False,
            endpoints={
                "render": [ep(render_a, "old"), ep(render_b, "p1")],
                "decode": [ep(decode, "p1")],
            },
        )
    )
    assert (await only_b.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert stack.renders[0].metrics.requests._metrics == {}  # the old-template replica idles
    mixed = await stack.gateway(
        routing(
            prefill=False, endpoints={"render": [ep(render_a, "old")], "decode": [ep(decode, "p1")]}
        ),
        endpoint_wait_seconds=0.2,
    )
    response = await mixed.post("/v1/chat/completions", json=PLAIN)
    assert response.status_code == 503
    assert "refusing to mix chat templates or parsers" in response.json()["error"]["message"]
    assert (await mixed.get("/ready")).status_code == 503


async def test_a_request_waits_for_a_replaced_pools_new_replica_then_is_served(
    stack: Stack,
) -> None:
    """A pool's only replica being replaced (a parity rollout, a restart) holds requests for
    the bound instead of failing them; they are served once discovery finds the new one."""
    render = await stack.render()
    decode = await stack.engine("both", engine("both"))
    client = await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(render, "p1")], "decode": []}),
        endpoint_wait_seconds=30,
    )
    assert stack.gateway_server is not None
    waiting = asyncio.create_task(client.post("/v1/chat/completions", json=PLAIN))

    async def held() -> None:
        while "pdserve_gateway_inflight_requests 1.0" not in (await client.get("/metrics")).text:  # noqa: ASYNC110 - polled with a deadline
            await asyncio.sleep(0.01)

    await asyncio.wait_for(held(), timeout=10)
    assert not waiting.done()  # with no decode endpoint it can only be waiting
    stack.gateway_server.endpoints.replace("decode", [Endpoint(decode.rstrip("/"), "p1")])
    response = await asyncio.wait_for(waiting, timeout=10)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "request body is not valid JSON"),
        (
            json.dumps({**PLAIN, "model": "gpt-4"}).encode(),
            404,
            "The model `gpt-4` does not exist.",
        ),
        (
            json.dumps({**PLAIN, "max_tokens": 0}).encode(),
            400,
            "max_tokens must be a positive integer",
        ),
        (
            json.dumps({**PLAIN, "max_tokens": 100000}).encode(),
            400,
            "max_tokens may be at most 4096",
        ),
        (json.dumps({**PLAIN, "stream": "yes"}).encode(), 400, "stream must be true or false"),
        (json.dumps({**PLAIN, "messages": []}).encode(), 400, "messages: must be a non-empty list"),
    ],
)
async def test_bad_requests_get_clear_errors(
    stack: Stack, body: bytes, status: int, message: str
) -> None:
    render = await stack.render()
    decode = await stack.engine("both", engine("both"))
    client = await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(render)], "decode": [ep(decode)]}),
        max_tokens_cap=4096,
    )
    response = await client.post(
        "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == status
    assert response.json()["error"]["message"].startswith(message)


async def test_api_keys_are_required_when_configured(stack: Stack) -> None:
    render = await stack.render()
    decode = await stack.engine("both", engine("both"))
    client = await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(render)], "decode": [ep(decode)]}),
        api_keys=("secret-1", "secret-2"),
    )
    assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 401
    wrong = await client.post(
        "/v1/chat/completions", json=PLAIN, headers={"Authorization": "Bearer nope"}
    )
    assert wrong.status_code == 401
    ok = await client.post(
        "/v1/chat/completions", json=PLAIN, headers={"Authorization": "Bearer secret-2"}
    )
    assert ok.status_code == 200


async def test_full_gateway_answers_429_with_retry_after(stack: Stack) -> None:
    render = await stack.render()
    decode = await stack.engine("both", engine("both"))
    client = await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(render)], "decode": [ep(decode)]}),
        max_inflight=1,
    )
    slow = asyncio.create_task(
        client.post("/v1/chat/completions", json={**PLAIN, "max_tokens": 3000, "ignore_eos": True})
    )
    gateway = stack.gateway_server
    while not gateway._slots.locked():  # noqa: ASYNC110 - polling another task's state
        await asyncio.sleep(0.005)
    response = await client.post("/v1/chat/completions", json=PLAIN)
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "1"
    assert (await slow).status_code == 200


async def test_n_choices_stream_and_not(stack: Stack) -> None:
    client = await pd_stack(stack)
    body = {**PLAIN, "n": 2, "seed": 3}
    answer = (await client.post("/v1/chat/completions", json=body)).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    events = await sse_events(client, body)
    assert events[-1] == "[DONE]"
    by_index: dict[int, str] = {0: "", 1: ""}
    for event in events[:-1]:
        for choice in event["choices"]:
            by_index[choice["index"]] += choice["delta"].get("content") or ""
    assert by_index[0] == answer["choices"][0]["message"]["content"]
    assert by_index[1] == answer["choices"][1]["message"]["content"]


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
        chat_request={},
        pipelining=GatewaySettings().derender_pipelining,
    )
    pipeline = DerenderPipeline(derender, 0, FakeWriter(), metrics)  # type: ignore[arg-type]
    pipeline.push([5, 6], None)
    pipeline.push([7], None)
    pipeline.queue.put_nowait(([], "__abandoned__"))  # queued before the pipeline runs
    await asyncio.wait_for(pipeline.task, timeout=5)
    assert [c["generate_chunk"]["choices"][0]["token_ids"] for c in calls] == [[5, 6, 7]]


async def test_a_lease_that_would_expire_before_decode_is_not_used(stack: Stack) -> None:
    short_lease = engine("prefill")
    short_lease.transfer = TransferConfig(lease_seconds=0.5)
    client = await pd_stack(stack, prefill_config=short_lease)
    assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert 'reason="lease_expiring"' in (await client.get("/metrics")).text
    assert stack.engines["prefill"].core.held_blocks == 0  # the lease was released at once
    assert stack.engines["decode"].core.prefix_queries > 0  # decode prefilled itself


LONG = {**PLAIN, "messages": [{"role": "user", "content": " ".join(["hello world"] * 400)}],
        "max_tokens": 20}  # fmt: skip


async def test_auto_mode_prefills_short_prompts_locally_and_long_ones_on_prefill(
    stack: Stack,
) -> None:
    client = await pd_stack(stack, mode="Auto", load_scrape_seconds=None)
    assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert stack.engines["prefill"].core.prefix_queries == 0  # short: prefilled on decode
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    # Nothing else runs on decode: a local prefill stalls no stream, and skips the handoff.
    assert stack.engines["prefill"].core.prefix_queries == 0
    busy_decode(stack)
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    assert stack.engines["prefill"].core.prefix_queries > 0  # long, decode busy: prefill pool
    metrics = (await client.get("/metrics")).text
    for reason in ("short_prompt", "decode_idle", "long_prompt"):
        assert f'pdserve_gateway_auto_decisions_total{{reason="{reason}"}} 1.0' in metrics
    # Requests are counted under the route they took, not the one Auto started from.
    assert 'pdserve_gateway_requests_total{outcome="ok",route="render"} 2.0' in metrics
    assert 'pdserve_gateway_requests_total{outcome="ok",route="render_pd"} 1.0' in metrics


def busy_decode(stack: Stack) -> None:
    """Streams of other clients on the decode replica, as its scraped metrics would say."""
    for endpoint in stack.gateway_server.endpoints.pools["decode"]:
        endpoint.running = 3


async def test_auto_mode_stops_using_a_kv_path_too_slow_for_the_ttft_slo(stack: Stack) -> None:
    slow = engine("decode")
    slow.transfer = TransferConfig(overhead_ms=20_000)  # 0.2 s real at this time scale
    client = await pd_stack(
        stack, decode_config=slow, mode="Auto", slo={"ttftMs": 100}, load_scrape_seconds=None
    )
    busy_decode(stack)
    first = await sse_events(client, LONG)
    assert first[-1] == "[DONE]"
    second = await client.post("/v1/chat/completions", json=LONG)
    assert second.status_code == 200
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_auto_decisions_total{reason="handoff_over_ttft_budget"} 1.0' in metrics
    status = (await client.get("/status")).json()
    assert status["handoffSecondsPerToken"] > 0


async def test_auto_learns_the_kv_path_from_decodes_transfer_metrics_without_streams(
    stack: Stack,
) -> None:
    """Non-streamed requests give the gateway no first-token time to measure the handoff by:
    the decode engine's vllm:nixl_xfer_time_seconds does (read in the engine's simulated
    seconds, scaled like the engines' time). Until the first handoff is known, one request at a
    time learns the path while the others run whole on the least loaded engine."""
    slow = engine("decode")
    slow.transfer = TransferConfig(overhead_ms=20_000)  # 20 s simulated: 0.2 s real
    client = await pd_stack(
        stack,
        decode_config=slow,
        mode="Auto",
        slo={"ttftMs": 100},
        load_scrape_seconds=0.05,
        engine_seconds_scale=0.01,
    )
    # No other streams here: keep Auto from prefilling on the idle decode replica. The policy's
    # clock stands still: the learning request's window (two TTFT budgets, 0.2 s) cannot run
    # out while a busy machine is slow to bring the second request to its decision.
    stack.gateway_server.policy = AutoPolicy(
        PolicySettings(local_when_decode_idle=False), clock=lambda: 0.0
    )
    first, second = await asyncio.gather(
        client.post("/v1/chat/completions", json=LONG),
        client.post("/v1/chat/completions", json={**LONG, "max_tokens": 21}),
    )
    assert (first.status_code, second.status_code) == (200, 200)
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_auto_decisions_total{reason="long_prompt"} 1.0' in metrics
    assert 'pdserve_gateway_auto_decisions_total{reason="handoff_unknown"} 1.0' in metrics
    # The learning request was not streamed: only the engine's transfer metrics measured it.
    assert stack.gateway_server.metrics.stage.labels("kv_handoff")._sum.get() == 0

    async def learnt() -> float:
        while True:  # the scraper task learns it: poll the status endpoint a user would read
            estimate = (await client.get("/status")).json()["handoffSecondsPerToken"]
            if estimate is not None:
                return float(estimate)
            await asyncio.sleep(0.02)

    per_token = await asyncio.wait_for(learnt(), timeout=5)
    tokens = stack.gateway_server.policy.health.pd_prompt_tokens
    assert tokens is not None
    # Read in the engine's seconds, scaled: at least the transfer's 20 simulated seconds (0.2 s),
    # and nowhere near the unscaled 20 s however long a busy machine stretches the transfer.
    assert 0.2 * 0.99 <= per_token * tokens < 2.0
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_auto_decisions_total{reason="handoff_over_ttft_budget"} 1.0' in metrics


async def test_engine_load_is_scraped_from_their_metrics(stack: Stack) -> None:
    render = await stack.render()
    decode = await stack.engine("both", engine("both"))
    await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(render)], "decode": [ep(decode)]}),
        load_scrape_seconds=0.05,
    )
    stack.engines["both"].core.waiting.append(object())  # type: ignore[arg-type]
    [endpoint] = stack.gateway_server.endpoints.pools["decode"]

    async def scraped() -> None:
        while endpoint.waiting != 1:  # noqa: ASYNC110 - the scraper task updates it
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(scraped(), timeout=5)
    finally:
        stack.engines["both"].core.waiting.clear()


async def test_repeated_prefixes_and_conversations_stay_on_one_engine(stack: Stack) -> None:
    render = await stack.render()
    urls = {name: await stack.engine(name, engine("both")) for name in ("first", "second")}
    client = await stack.gateway(
        routing(
            prefill=False,
            endpoints={"render": [ep(render)], "decode": [ep(urls["first"]), ep(urls["second"])]},
        ),
        load_scrape_seconds=None,
    )
    endpoints = {e.url: e for e in stack.gateway_server.endpoints.pools["decode"]}

    def busy(name: str) -> None:
        # Busier than the other engine, within the slack: plain load-based picking would move.
        endpoints[urls[name]].running = 2

    def engine_that_grew(before: dict[str, int]) -> list[str]:
        return [n for n in urls if stack.engines[n].core.prefix_queries > before[n]]

    def queries() -> dict[str, int]:
        return {n: stack.engines[n].core.prefix_queries for n in urls}

    before = queries()
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    [holder] = engine_that_grew(before)
    busy(holder)
    before = queries()
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    assert engine_that_grew(before) == [holder]  # its prefix cache beat the lighter engine
    assert stack.engines[holder].core.prefix_hits > 0

    for endpoint in endpoints.values():
        endpoint.running = 0
    before = queries()
    body = {**PLAIN, "messages": [{"role": "user", "content": "hello"}], "conversation_id": "c-7"}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    [home] = engine_that_grew(before)
    busy(home)
    for turn in ("tell me more", "and then"):
        before = queries()
        body = {**PLAIN, "messages": [{"role": "user", "content": turn}], "conversation_id": "c-7"}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        assert engine_that_grew(before) == [home]  # the conversation stays put


async def test_short_prompts_overtake_queued_documents_and_aging_bounds_their_wait(
    stack: Stack,
) -> None:
    from pdserve.gateway.fairqueue import FairQueueSettings

    client = await pd_stack(
        stack,
        fair_queue=FairQueueSettings(
            long_prompt_tokens=500, max_long_per_replica=1, max_wait_seconds=0.5
        ),
    )
    prefill_port = stack.engines["prefill"].config.port
    async with httpx.AsyncClient() as admin:
        await admin.post(f"http://127.0.0.1:{prefill_port}/sim/faults", json={"hang": 1})
    stuck = asyncio.create_task(client.post("/v1/chat/completions", json=LONG, timeout=30))
    gateway = stack.gateway_server
    while gateway.admission.long_in_flight == 0:  # noqa: ASYNC110 - the first document holds the slot
        await asyncio.sleep(0.01)
    queued = asyncio.create_task(client.post("/v1/chat/completions", json=LONG))
    while not gateway.admission.queue:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    assert (await client.get("/metrics")).text.count("pdserve_gateway_prefill_queue_long 1.0") == 1
    chat = await client.post("/v1/chat/completions", json=PLAIN)  # a chat does not wait
    assert chat.status_code == 200
    assert not queued.done()
    assert (await queued).status_code == 200  # admitted by aging although the slot stays busy
    assert gateway.admission.aged == 1
    stuck.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await stuck


def finished(server: Any) -> float:
    """Requests an engine finished (its vllm:request_success counter)."""
    return sum(
        float(sample.value)
        for metric in server.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "vllm:request_success_total"
    )


async def test_verify_required_keeps_pd_on_verified_slices_and_decode_in_the_same_slice(
    stack: Stack,
) -> None:
    render = await stack.render()
    urls = {
        name: await stack.engine(name, engine(role))
        for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))
    }

    def sliced(name: str, slice_index: str, transport: str) -> dict[str, Any]:
        return {**ep(urls[name]), "slice": slice_index, "kvTransport": transport}

    config = routing(endpoints={
        "render": [ep(render)],
        "prefill": [sliced("p0", "0", "Failed"), sliced("p1", "1", "Verified")],
        "decode": [sliced("d0", "0", "Failed"), sliced("d1", "1", "Verified")],
    })  # fmt: skip
    config["kvTransfer"] = {"verify": "Required"}
    client = await stack.gateway(config, load_scrape_seconds=None)
    for _ in range(3):
        assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert [finished(stack.engines[n]) for n in ("p0", "p1", "d0", "d1")] == [0, 3, 0, 3]

    # The operator marks slice 1 failed too: no verified KV path is left, so requests prefill
    # locally on decode instead of failing (even in Disaggregated mode).
    stack.gateway_server.endpoints.pools["prefill"][1].kv_transport = "Failed"
    assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert finished(stack.engines["p1"]) == 3
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_fallbacks_total{reason="transport_unverified"} 1.0' in metrics


@pytest.mark.parametrize("engine_api", ["tokens", "openai"])
async def test_streams_teach_auto_the_decode_step_time_and_answer_length(
    stack: Stack, engine_api: str
) -> None:
    """What Auto's ITL rule reads: each decode engine's recent time between tokens, and how
    long answers run, from the streams the gateway relays (both engine APIs)."""
    prefill = await stack.engine("prefill", engine("prefill", api=engine_api))
    decode_url = await stack.engine("decode", engine("decode", api=engine_api))
    endpoints: dict[str, Any] = {"prefill": [ep(prefill)], "decode": [ep(decode_url)]}
    if engine_api == "tokens":
        endpoints["render"] = [ep(await stack.render())]
    config = routing(engine_api, render=engine_api == "tokens", endpoints=endpoints)
    client = await stack.gateway(config, step_window_seconds=0.001)
    events = await sse_events(client, {**PLAIN, "max_tokens": 20})
    assert events[-1] == "[DONE]"
    gateway = stack.gateway_server
    [decode] = gateway.endpoints.pools["decode"]
    assert decode.steps.seconds is not None
    assert 0 < decode.steps.seconds < 1
    assert gateway.policy.output_tokens is not None
    assert 10 <= gateway.policy.output_tokens <= 21


async def test_auto_mode_learns_each_slices_kv_path_and_avoids_only_the_slow_one(
    stack: Stack,
) -> None:
    """Two slices; slice 1's decode pulls KV slowly (a TCP fallback, say): once Auto has seen a
    handoff through each prefill replica, P/D goes through slice 0 only, even while its prefill
    replica is the busier one, instead of giving up P/D for every request."""
    render = await stack.render()
    slow = engine("decode")
    slow.transfer = TransferConfig(overhead_ms=20_000)  # 0.2 s real at this time scale
    configs = {"p0": engine("prefill"), "p1": engine("prefill"), "d0": engine("decode"), "d1": slow}
    urls = {name: await stack.engine(name, config) for name, config in configs.items()}

    def sliced(name: str, slice_index: str) -> dict[str, Any]:
        return {**ep(urls[name]), "slice": slice_index}

    config = routing(mode="Auto", slo={"ttftMs": 150}, endpoints={
        "render": [ep(render)],
        "prefill": [sliced("p0", "0"), sliced("p1", "1")],
        "decode": [sliced("d0", "0"), sliced("d1", "1")],
    })  # fmt: skip
    client = await stack.gateway(config, load_scrape_seconds=None)
    pools = stack.gateway_server.endpoints.pools
    for endpoint in pools["decode"]:
        endpoint.running = 3  # other streams: no idle decode to prefill on
    p0, p1 = pools["prefill"]

    def document(n: int) -> dict[str, Any]:  # no shared prefix: nothing pulls it to one replica
        return {**LONG, "messages": [{"role": "user", "content": f"doc {n} " * 400}]}

    for n, busy in enumerate((p1, p0)):  # one handoff through each slice
        busy.running = 2
        assert (await sse_events(client, document(n)))[-1] == "[DONE]"  # streams time handoffs
        busy.running = 0
    assert [finished(stack.engines[n]) for n in ("p0", "p1", "d0", "d1")] == [1, 1, 1, 1]
    estimates = (await client.get("/status")).json()["handoffSecondsPerTokenByPrefill"]
    assert set(estimates) == {urls["p0"], urls["p1"]}  # learnt per replica
    # What the policy concludes from them, not how many times faster one path measured: slice
    # 1's KV path alone would miss the 150 ms TTFT budget, slice 0's would not.
    health = stack.gateway_server.policy.health
    tokens = int(health.pd_prompt_tokens or 0)
    slow_path = health.predicted_handoff(tokens, urls["p1"])
    fast_path = health.predicted_handoff(tokens, urls["p0"])
    assert slow_path is not None
    assert fast_path is not None
    assert slow_path > 0.150 > fast_path

    p0.running = 2  # slice 0's prefill is now the busier one
    assert (await sse_events(client, document(2)))[-1] == "[DONE]"
    assert [finished(stack.engines[n]) for n in ("p0", "p1", "d0", "d1")] == [2, 1, 2, 1]
    metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_auto_decisions_total{reason="long_prompt"} 3.0' in metrics


async def test_transport_health_follows_the_decode_engines_nixl_metrics(stack: Stack) -> None:
    """The operator's scraper against real simulated engines: healthy transfers, then failed
    ones, then ones slower than the budget (half of a 5 s TTFT SLO). Simulated time runs 100x
    faster than real time, so scheduling jitter counts for a lot: the budget leaves room."""
    client = await pd_stack(stack)
    decode = f"http://127.0.0.1:{stack.engines['decode'].config.port}"
    changed: list[tuple[str, str]] = []
    monitor = TransportMonitor(changed.append, interval=0)
    key = ("llm", "qwen")
    gateway = str(client.base_url).rstrip("/")
    monitor.track(key, [f"{decode}/metrics"], budget=2.5, gateways=[gateway])
    try:
        await monitor.scrape_once()
        assert monitor.verdict(key) is None  # no transfer yet

        async def send(faults: dict[str, int] | None = None) -> HealthVerdict | None:
            if faults:
                await httpx.AsyncClient().post(f"{decode}/sim/faults", json=faults)
            for _ in range(2):
                assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
            await monitor.scrape_once()
            return monitor.verdict(key)

        healthy = await send()
        assert healthy is not None
        assert (healthy.healthy, healthy.reason) == (True, "Healthy")
        assert healthy.message.startswith("2 transfers, average ")
        failing = await send({"fail_transfers": 1})
        assert failing is not None
        assert (failing.healthy, failing.reason) == (False, "TransferFailures")
        slow = await send({"delay_transfers": 2, "delay_ms": 20000})
        assert slow is not None
        assert (slow.healthy, slow.reason) == (False, "SlowTransfers")
        assert "budget 2500 ms" in slow.message
        assert changed == [key, key, key]  # each flip asks for a reconcile
        # The gateway gave up on P/D (Auto mode degraded): the condition says so, whatever the
        # engines' last window looked like, until the gateway recovers.
        stack.gateway_server.policy.health.degraded = True
        await monitor.scrape_once()
        fallback = monitor.verdict(key)
        assert fallback is not None
        assert (fallback.healthy, fallback.reason) == (False, "GatewayFallback")
        assert fallback.message.startswith("1 of 1 gateway replicas prefill everything locally")
        stack.gateway_server.policy.health.degraded = False
        await monitor.scrape_once()
        assert monitor.verdict(key) == slow
        await stack.exits.aclose()  # engines gone
        await monitor.scrape_once()
        gone = monitor.verdict(key)
        assert gone is not None
        assert gone.reason == "MetricsUnreachable"
    finally:
        await monitor.close()


async def test_bidirectional_kv_of_the_last_turn_is_reused_by_the_next_turns_prefill(
    stack: Stack,
) -> None:
    def bidirectional(role: str) -> EngineConfig:
        config = engine(role)
        config.transfer = TransferConfig(bidirectional=True)
        return config

    client = await pd_stack(
        stack,
        prefill_config=bidirectional("prefill"),
        decode_config=bidirectional("decode"),
        kv_transfer={"bidirectional": True},
        load_scrape_seconds=None,
    )
    history = [{"role": "user", "content": " ".join(["tell me about the weather"] * 30)}]
    first = await client.post(
        "/v1/chat/completions", json={**PLAIN, "messages": history, "conversation_id": "c-1"}
    )
    assert first.status_code == 200, first.text
    history += [
        first.json()["choices"][0]["message"],
        {"role": "user", "content": "and tomorrow?"},
    ]
    second = await client.post(
        "/v1/chat/completions", json={**PLAIN, "messages": history, "conversation_id": "c-1"}
    )
    assert second.status_code == 200, second.text
    gateway_metrics = (await client.get("/metrics")).text
    assert 'pdserve_gateway_bidirectional_reuse_total{outcome="reused"} 1.0' in gateway_metrics
    prefill_metrics = stack.engines["prefill"].metrics.registry
    reused = sum(
        float(sample.value)
        for metric in prefill_metrics.collect()
        for sample in metric.samples
        if sample.name == "pdserve_sim_bidirectional_reused_tokens_total"
    )
    assert reused >= 150  # the first turn's prompt, at least, came back from decode

    # Another conversation never gets this one's KV.
    other = await client.post(
        "/v1/chat/completions", json={**PLAIN, "messages": history, "conversation_id": "c-2"}
    )
    assert other.status_code == 200
    assert 'outcome="reused"} 1.0' in (await client.get("/metrics")).text


@dataclass
class Replicas:
    gateways: list[Gateway]
    clients: list[httpx.AsyncClient]
    urls: list[str]
    prefill: EngineServer

    @property
    def leader(self) -> int:
        return self.urls.index(min(self.urls))

    @property
    def follower(self) -> int:
        return 1 - self.leader

    def reached_prefill(self, hung: int) -> int:
        """How many of the `hung` requests the prefill engine was told to hang it received."""
        return hung - self.prefill.faults.hang


def local_url(above: str = "") -> str:
    """A free loopback URL sorting after `above` (the leader is the lowest URL)."""
    while (url := f"http://127.0.0.1:{free_port()}") <= above:
        pass
    return url


async def gateway_replicas(
    stack: Stack, hang: int, extra_peers: tuple[str, ...] = (), max_wait: float = 30
) -> Replicas:
    """Two gateway replicas over one prefill replica with a long-prefill limit of 1, each
    knowing the other (and its own URL), the prefill engine hanging the next `hang` requests."""
    from pdserve.gateway.fairqueue import FairQueueSettings

    render = await stack.render()
    prefill = await stack.engine("prefill", engine("prefill"))
    decode = await stack.engine("decode", engine("decode"))
    endpoints: dict[str, Any] = {
        "render": [ep(render)],
        "prefill": [ep(prefill)],
        "decode": [ep(decode)],
    }
    urls = [local_url(min(extra_peers, default="")) for _ in range(2)]
    fair = FairQueueSettings(
        long_prompt_tokens=500, max_long_per_replica=1, max_wait_seconds=max_wait
    )
    gateways, clients = [], []
    for mine, theirs in (urls, urls[::-1]):
        config = routing(endpoints={**endpoints, "peers": [theirs, *extra_peers], "selfUrl": mine})
        gateway = Gateway(GatewayConfig.model_validate(config), GatewaySettings(fair_queue=fair))
        await stack.start(gateway, int(mine.rsplit(":", 1)[1]))
        gateways.append(gateway)
        clients.append(
            await stack.exits.enter_async_context(httpx.AsyncClient(base_url=mine, timeout=60))
        )
    async with httpx.AsyncClient() as admin:
        await admin.post(f"{prefill}/sim/faults", json={"hang": hang})
    await until(lambda: all(len(g.peers.live) >= 1 for g in gateways))  # they see each other
    return Replicas(gateways, clients, urls, stack.engines["prefill"])


async def until(condition: Callable[[], bool], deadline_seconds: float = 20) -> None:
    async def poll() -> None:
        while not condition():  # noqa: ASYNC110 - the gateways' tasks change the state
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), deadline_seconds)


async def test_gateway_replicas_admit_long_prefills_through_one_leader_exactly(
    stack: Stack,
) -> None:
    """Limit 1 over one prefill replica: documents sent to both replicas in the same instant
    reach the engine one at a time (each replica deciding alone admits one each: 2 at once).
    The leader queues everyone's in arrival order; a follower's client leaving frees its slot
    on the leader for the next document, whichever replica it came through."""
    replicas = await gateway_replicas(stack, hang=10)
    leader = replicas.gateways[replicas.leader]
    # The follower's document first: its slot is held on the leader.
    first = asyncio.create_task(
        replicas.clients[replicas.follower].post("/v1/chat/completions", json=LONG)
    )
    await until(lambda: replicas.reached_prefill(10) == 1)
    # The follower reports the slot it holds through the leader (counted if the leader dies).
    held = (await replicas.clients[replicas.follower].get("/admission")).json()["heldAt"]
    assert held == {replicas.urls[replicas.leader]: dict(leader.admission.in_flight)}
    assert sum(leader.admission.in_flight.values()) == 1
    burst = [
        asyncio.create_task(client.post("/v1/chat/completions", json=LONG))
        for client in replicas.clients * 2
    ]

    def accounted() -> int:
        return sum(len(g.admission.queue) for g in replicas.gateways) + replicas.reached_prefill(10)

    await until(lambda: accounted() == 5)  # all five documents queued or at the engine
    assert replicas.reached_prefill(10) == 1
    assert (leader.admission.long_in_flight, len(leader.admission.queue)) == (1, 4)
    assert (await replicas.clients[replicas.follower].get("/status")).json()["admission"] == {
        "leader": replicas.urls[replicas.leader],
        "peers": [replicas.urls[replicas.leader]],
    }
    assert replicas.gateways[replicas.follower].admission.long_in_flight == 0  # it decides nothing
    state = (await replicas.clients[replicas.follower].get("/metrics")).text
    assert "pdserve_gateway_admission_leader_errors 0.0" in state

    first.cancel()  # its client leaves: the follower closes its hold, the leader passes it on
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await first
    await until(lambda: len(leader.admission.queue) == 3)
    assert leader.admission.long_in_flight == 1
    assert replicas.reached_prefill(10) == 2
    assert leader.admission.aged == 0  # passed on by the release, not by aging
    for task in burst:
        task.cancel()
    await asyncio.gather(*burst, return_exceptions=True)
    await until(lambda: leader.admission.long_in_flight == 0 and not leader.admission.queue)


async def test_a_long_prefill_goes_to_a_replica_with_room_even_against_affinity(
    stack: Stack,
) -> None:
    """Limit 1 per prefill replica: a conversation's documents prefer the replica that served
    it, but while one of them prefills there the next goes to the other replica."""
    from pdserve.gateway.fairqueue import FairQueueSettings

    render = await stack.render()
    prefills = [await stack.engine(name, engine("prefill")) for name in ("p0", "p1")]
    decode = await stack.engine("decode", engine("decode"))
    endpoints = {"render": [ep(render)], "prefill": [ep(u) for u in prefills],
                 "decode": [ep(decode)]}  # fmt: skip
    fair = FairQueueSettings(long_prompt_tokens=500, max_long_per_replica=1, max_wait_seconds=30)
    client = await stack.gateway(routing(endpoints=endpoints), fair_queue=fair)
    turn = {**LONG, "conversation_id": "c-1"}
    assert (await client.post("/v1/chat/completions", json=turn)).status_code == 200
    served = [name for name in ("p0", "p1") if stack.engines[name].core.prefix_queries]
    assert len(served) == 1  # the conversation's replica
    async with httpx.AsyncClient() as admin:
        for url in prefills:
            await admin.post(f"{url}/sim/faults", json={"hang": 2})
    documents = [
        asyncio.create_task(client.post("/v1/chat/completions", json=turn)) for _ in range(2)
    ]

    def hung() -> dict[str, int]:
        return {name: 2 - stack.engines[name].faults.hang for name in ("p0", "p1")}

    await until(lambda: sum(hung().values()) == 2)
    assert hung() == {"p0": 1, "p1": 1}  # not both on the conversation's replica
    for task in documents:
        task.cancel()
    await asyncio.gather(*documents, return_exceptions=True)


async def test_a_malformed_hold_request_is_refused_naming_the_field(stack: Stack) -> None:
    client = await pd_stack(stack)
    bodies: list[Any] = [{}, {"replicas": "http://p0"}, {"replicas": []}, {"replicas": [3]}, [1]]
    for body in bodies:
        answer = await client.post("/admission/hold", json=body)
        assert answer.status_code == 400, body
        assert answer.json()["error"]["param"] == "replicas"
    assert stack.gateway_server.admission.long_in_flight == 0


@pytest.mark.parametrize("leader", ["without /admission/hold", "stuck"])
async def test_a_replica_that_cannot_ask_the_leader_admits_on_its_own(
    stack: Stack, leader: str
) -> None:
    """A peer that sorts lowest, so it leads, but cannot grant: an older replica without
    /admission/hold, or a stuck one that accepts the hold and never answers (no grant within
    twice the aging bound). The replicas admit on their own, counting what each other holds,
    and say so in a metric; no request is lost."""
    stand_in = web.Application()

    async def admission(_: web.Request) -> web.Response:
        return web.json_response({"longInFlight": 0, "queued": 0})

    async def stuck(_: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    stand_in.router.add_get("/admission", admission)
    if leader == "stuck":
        stand_in.router.add_post("/admission/hold", stuck)
    while True:  # a free port with many free ports' URLs sorting after it
        lowest = local_url()
        if lowest < "http://127.0.0.1:6":
            break
    await stack.exits.enter_async_context(serving(stand_in, port=int(lowest.rsplit(":", 1)[1])))
    replicas = await gateway_replicas(stack, hang=0, extra_peers=(lowest,), max_wait=0.2)
    await until(lambda: all(g.peers.leader() == lowest for g in replicas.gateways))
    answers = await asyncio.gather(
        *(client.post("/v1/chat/completions", json=LONG) for client in replicas.clients)
    )
    assert [a.status_code for a in answers] == [200, 200]
    assert [g.peers.leader_errors for g in replicas.gateways] == [1, 1]
    state = (await replicas.clients[0].get("/metrics")).text
    assert "pdserve_gateway_admission_leader_errors 1.0" in state


async def test_only_the_leader_grants_holds_and_only_to_its_own_replicas(stack: Stack) -> None:
    """A follower refuses holds (two queues at once would break the limit); with API keys set,
    a hold needs one (a slot held blocks every replica's documents)."""
    replicas = await gateway_replicas(stack, hang=0)
    follower = replicas.clients[replicas.follower]
    body = {"replicas": ["http://p0"]}
    refused = await follower.post("/admission/hold", json=body)
    assert refused.status_code == 409
    assert replicas.urls[replicas.leader] in refused.json()["error"]["message"]

    keyed = await pd_stack(stack, api_keys=("secret",))
    assert (await keyed.post("/admission/hold", json=body)).status_code == 401
    auth = {"Authorization": "Bearer secret"}
    async with keyed.stream("POST", "/admission/hold", json=body, headers=auth) as granted:
        assert granted.status_code == 200
        assert await granted.aiter_lines().__anext__() == "granted http://p0"
        assert stack.gateway_server.admission.in_flight == {"http://p0": 1}
    await until(lambda: not stack.gateway_server.admission.in_flight)  # closed: released


async def test_a_long_prompt_moves_to_another_prefill_replica_when_its_own_fails(
    stack: Stack,
) -> None:
    """The replica a document was granted answers 5xx: its slot goes back and the next replica
    with room prefills it, rather than falling back to local prefill on decode."""
    from pdserve.gateway.fairqueue import FairQueueSettings

    render = await stack.render()
    prefills = [await stack.engine(name, engine("prefill")) for name in ("p0", "p1")]
    decode = await stack.engine("decode", engine("decode"))
    endpoints = {"render": [ep(render)], "prefill": [ep(u) for u in prefills],
                 "decode": [ep(decode)]}  # fmt: skip
    fair = FairQueueSettings(long_prompt_tokens=500, max_long_per_replica=1)
    client = await stack.gateway(routing(endpoints=endpoints), fair_queue=fair,
                                 load_scrape_seconds=None)  # fmt: skip
    stack.gateway_server.endpoints.pools["prefill"][1].running = 1  # p0 is the first choice
    async with httpx.AsyncClient() as admin:
        await admin.post(f"{prefills[0]}/sim/faults", json={"http_5xx": 1})
    assert (await client.post("/v1/chat/completions", json=LONG)).status_code == 200
    assert [finished(stack.engines[n]) for n in ("p0", "p1")] == [0, 1]
    metrics = (await client.get("/metrics")).text
    assert "prefill_failed" not in metrics
    assert 'pdserve_gateway_retries_total{reason="upstream_error",stage="prefill"} 1.0' in metrics
    assert stack.gateway_server.admission.in_flight == {}


async def test_auto_mode_may_run_a_local_request_whole_on_an_idle_prefill_replica(
    stack: Stack,
) -> None:
    """While the P/D path is unusable (here: degraded by failures), local requests may run on the
    least loaded engine of both pools: a prefill engine answers a request without KV params.
    Otherwise local requests stay on decode, keeping the prefill pool for P/D."""
    client = await pd_stack(stack, mode="Auto", load_scrape_seconds=None)
    busy_decode(stack)
    assert (await client.post("/v1/chat/completions", json=PLAIN)).status_code == 200
    assert (finished(stack.engines["prefill"]), finished(stack.engines["decode"])) == (0, 1)
    stack.gateway_server.policy.health.degraded = True
    answer = await client.post("/v1/chat/completions", json=LONG)
    assert answer.status_code == 200
    message = answer.json()["choices"][0]["message"]
    assert message.get("content") or message.get("reasoning_content")
    assert (finished(stack.engines["prefill"]), finished(stack.engines["decode"])) == (1, 1)


async def test_openai_streams_count_on_their_engine_at_once(stack: Stack) -> None:
    """Two streams sent before any metrics scrape land on different engines: the gateway
    counts a stream (and its prompt still to prefill) on its engine when it opens it."""
    urls = [await stack.engine(n, engine("both", api="openai")) for n in ("first", "second")]
    client = await stack.gateway(
        routing("openai", render=False, prefill=False,
                endpoints={"decode": [ep(u) for u in urls]}),
        load_scrape_seconds=None,
    )  # fmt: skip
    streams = [asyncio.create_task(sse_events(client, LONG)) for _ in range(2)]
    for events in await asyncio.gather(*streams):
        assert events[-1] == "[DONE]"
    assert [finished(stack.engines[n]) for n in ("first", "second")] == [1, 1]
    pool = stack.gateway_server.endpoints.pools["decode"]
    assert [(e.inflight, e.prefill_backlog) for e in pool] == [(0, 0), (0, 0)]
