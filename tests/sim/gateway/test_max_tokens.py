"""The client's output limit reaches the engine through render, on both request paths: a
render server leaves max_tokens out of its sampling params when it equals vLLM's default (16),
and a tokens engine reads a missing limit as the whole context left. The simulated render
server leaves it out as vLLM's does; the simulated engine, told ignore_eos, generates up to its
limit, so the count of completion tokens is the limit the engine got."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import httpx
import pytest

from pdserve.sim.engine_config import EngineConfig
from tests.support.served_gateway import REQUEST_PATHS
from tests.support.sim_gateway import MODEL, PLAIN, RENDER, Stack, engine, ep, routing, sse_events

# Without a limit of its own: each test names the one it asks for.
LIMITED = {**{k: v for k, v in PLAIN.items() if k != "max_tokens"}, "ignore_eos": True}
LIMITS = {
    "max_tokens": {"max_tokens": 16},
    "max_completion_tokens": {"max_completion_tokens": 16},
    # vLLM's precedence, applied by render: max_completion_tokens wins.
    "both": {"max_tokens": 40, "max_completion_tokens": 16},
}

# Small, so a limit lost on the way costs a few hundred tokens, not the simulator's 32k.
CONTEXT = 512


def small(role: str) -> EngineConfig:
    return replace(engine(role), max_model_len=CONTEXT,
                   render=replace(RENDER, max_model_len=CONTEXT))  # fmt: skip


async def render_stack(
    stack: Stack, request_path: str, *, pd: bool, **settings: Any
) -> httpx.AsyncClient:
    """A render server and a decode engine (with a prefill engine when `pd`), and a gateway
    over them on `request_path`."""
    render = await stack.render(replace(RENDER, max_model_len=CONTEXT))
    decode = await stack.engine("decode", small("decode" if pd else "both"))
    endpoints = {"render": [ep(render)], "decode": [ep(decode)]}
    if pd:
        endpoints["prefill"] = [ep(await stack.engine("prefill", small("prefill")))]
    config = routing(prefill=pd, endpoints=endpoints)
    return await stack.gateway(config, data_plane=request_path == "dataplane", **settings)


async def served_by_data_plane(stack: Stack) -> int:
    """Requests the data plane served itself on the render routes (not handed to Python)."""
    front = stack.gateway_server.data_plane
    assert front is not None
    assert front.control is not None
    async with httpx.AsyncClient() as client:
        stats = (await client.get(f"{front.control}/stats", headers=front.control_headers)).json()
    return int(stats["routes"]["render_decode"] + stats["routes"]["render_pd"])


async def completion(
    client: httpx.AsyncClient, body: dict[str, Any], *, stream: bool
) -> tuple[int, str]:
    """The answer's completion tokens and finish reason."""
    if not stream:
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        return whole["usage"]["completion_tokens"], whole["choices"][0]["finish_reason"]
    events = await sse_events(client, {**body, "stream_options": {"include_usage": True}})
    [finish] = [
        c["choices"][0]["finish_reason"] for c in events[:-2] if c["choices"][0]["finish_reason"]
    ]
    return events[-2]["usage"]["completion_tokens"], finish


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
@pytest.mark.parametrize("pd", [False, True], ids=["render-decode", "render-pd"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("limit", LIMITS)
async def test_a_limit_of_16_reaches_the_engine(
    stack: Stack, request_path: str, pd: bool, stream: bool, limit: str
) -> None:
    client = await render_stack(stack, request_path, pd=pd)
    got = await completion(client, {**LIMITED, **LIMITS[limit]}, stream=stream)
    assert got == (16, "length")
    if request_path == "dataplane":
        assert await served_by_data_plane(stack) == 1


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_a_max_tokens_cap_of_16_reaches_the_engine(stack: Stack, request_path: str) -> None:
    """Without a limit of its own a request gets the gateway's cap, which render then leaves out
    at 16 like any other 16; above the cap it is refused."""
    client = await render_stack(stack, request_path, pd=True, max_tokens_cap=16)
    assert await completion(client, LIMITED, stream=False) == (16, "length")
    refused = await client.post("/v1/chat/completions", json={**LIMITED, "max_tokens": 17})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_the_cap_on_completions_reads_only_max_tokens(
    stack: Stack, request_path: str
) -> None:
    """max_completion_tokens is a chat field: on /v1/completions vLLM ignores it, so it neither
    stands in for max_tokens (the cap is filled in) nor counts against the cap, whatever it
    holds (the fuzzer's `[null]` once made the cap check fail with a 500)."""
    client = await render_stack(stack, request_path, pd=False, max_tokens_cap=16)
    body = {"model": MODEL, "prompt": "Once upon a time", "ignore_eos": True}
    for ignored in (64, [None]):
        sent = await client.post("/v1/completions", json={**body, "max_completion_tokens": ignored})
        assert sent.status_code == 200, sent.text
        assert sent.json()["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_without_a_limit_the_answer_runs_to_the_end_of_the_context(
    stack: Stack, request_path: str
) -> None:
    """What vLLM's own chat endpoint does without max_tokens: the context left is the limit."""
    client = await render_stack(stack, request_path, pd=True)
    answer = (await client.post("/v1/chat/completions", json=LIMITED)).json()
    assert answer["usage"]["total_tokens"] == CONTEXT
    assert answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_a_limit_of_16_on_completions_reaches_the_engine(
    stack: Stack, request_path: str
) -> None:
    client = await render_stack(stack, request_path, pd=False)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True}
    answer = (await client.post("/v1/completions", json=body)).json()
    assert answer["usage"]["completion_tokens"] == 16
    assert answer["choices"][0]["finish_reason"] == "length"
    if request_path == "dataplane":
        assert await served_by_data_plane(stack) == 1
