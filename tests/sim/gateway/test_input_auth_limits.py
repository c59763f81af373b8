"""What the gateway refuses: bad requests (with clear errors), missing or wrong API keys, and
requests beyond its in-flight limit (429 with Retry-After)."""

from __future__ import annotations

import asyncio
import json

import pytest

from devtools.localplane import free_port
from tests.support.served_gateway import REQUEST_PATHS
from tests.support.sim_gateway import PLAIN, Stack, engine, ep, finished, routing


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
        (json.dumps({**PLAIN, "best_of": -1}).encode(), 400, "best_of must be a positive integer"),
        (json.dumps({**PLAIN, "logprobs": "abc"}).encode(), 400, "logprobs must be true or false"),
        (json.dumps({**PLAIN, "temperature": "hot"}).encode(), 400, "temperature must be a"),
        (json.dumps({**PLAIN, "stream_options": 1}).encode(), 400, "stream_options must be an"),
        (b'{"messages": "\xff"}', 400, "request body is not valid utf-8"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "request body is nested too deeply"),
        (
            json.dumps({**PLAIN, "stream": True, "logprobs": True}).encode(),
            400,
            "logprobs is not available with stream: true",
        ),
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
    assert finished(stack.engines["both"]) == 0
    render_calls = sum(
        sample.value
        for metric in stack.renders[0].metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "pdserve_sim_render_requests_total"
    )
    assert render_calls == 0  # refused before any render server or engine was called


async def test_render_down_everywhere_is_an_openai_502_without_addresses(stack: Stack) -> None:
    decode = await stack.engine("both", engine("both"))
    dead = f"http://127.0.0.1:{free_port()}"
    client = await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(dead)], "decode": [ep(decode)]})
    )
    for body in (PLAIN, {**PLAIN, "stream": True}):
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 502, response.text
        error = response.json()["error"]
        assert error["type"] == "UpstreamError"
        assert error["message"].startswith("render at a replica: ClientConnectorError")
        assert "127.0.0.1" not in error["message"]


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


@pytest.mark.parametrize("request_path", REQUEST_PATHS)
async def test_full_gateway_answers_429_with_retry_after(stack: Stack, request_path: str) -> None:
    render = await stack.render()
    decode = await stack.engine("both", engine("both"))
    client = await stack.gateway(
        routing(prefill=False, endpoints={"render": [ep(render)], "decode": [ep(decode)]}),
        max_inflight=1,
        data_plane=request_path == "dataplane",
    )
    slow = asyncio.create_task(
        client.post("/v1/chat/completions", json={**PLAIN, "max_tokens": 3000, "ignore_eos": True})
    )
    while not await stack.at_its_limit():  # noqa: ASYNC110 - polling another task's state
        await asyncio.sleep(0.005)
    response = await client.post("/v1/chat/completions", json=PLAIN)
    assert response.status_code == 429
    assert response.headers["Retry-After"] == "1"
    assert (await slow).status_code == 200
