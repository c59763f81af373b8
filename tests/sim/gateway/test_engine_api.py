"""What the engines behind render servers run decides what the tokens route serves (routing
config `tokensEngines`, from spec.render.engineApi): --tokens-only engines cannot apply stop
strings or structured outputs, so the gateway refuses those requests before render, naming the
parameter and the fix; --enable-scale-out engines serve them. Loopback, real gateway over
simulated render servers and engines."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.sim_gateway import MODEL, PLAIN, TOOLS, Stack, engine, ep, routing

COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "tell me a story", "max_tokens": 50}
NAMED_TOOL = {"type": "function", "function": {"name": "get_weather"}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}

# (chat?, what the body adds, the parameter refused)
NEEDS_A_TOKENIZER: list[tuple[bool, dict[str, Any], str]] = [
    (True, {"stop": "\n"}, "stop"),
    (True, {"stop": ["the end", "."]}, "stop"),
    (True, {"stop": ""}, "stop"),  # vLLM makes it [""]: a stop string all the same
    (True, {"response_format": {"type": "json_object"}}, "response_format"),
    (
        True,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": SCHEMA},
            }
        },
        "response_format",
    ),
    (True, {"response_format": {"type": "structural_tag", "format": {}}}, "response_format"),
    (True, {"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
    (True, {"guided_json": SCHEMA}, "guided_json"),
    (True, {"guided_regex": "[a-z]+"}, "guided_regex"),
    (True, {"guided_choice": ["yes", "no"]}, "guided_choice"),
    (True, {"guided_grammar": "root ::= 'x'"}, "guided_grammar"),
    (True, {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    (True, {"tools": TOOLS, "tool_choice": NAMED_TOOL}, "tool_choice"),
    (False, {"stop": ["\n"]}, "stop"),
    (False, {"response_format": {"type": "json_object"}}, "response_format"),
]
SERVED_BY_BOTH: list[tuple[bool, dict[str, Any]]] = [
    (True, {}),
    (True, {"stop": []}),
    (True, {"stop": None, "stop_token_ids": [7]}),
    (True, {"response_format": {"type": "text"}}),
    (True, {"tools": TOOLS, "tool_choice": "auto"}),
    (True, {"tools": TOOLS, "tool_choice": "none"}),
    (False, {}),
]


def body_of(chat: bool, changes: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if chat:
        return "/v1/chat/completions", {**PLAIN, "max_tokens": 50, **changes}
    return "/v1/completions", {**COMPLETION, **changes}


async def render_stack(stack: Stack, engines: str) -> httpx.AsyncClient:
    """Render, prefill and decode (engines: tokens = --tokens-only, scale_out =
    --enable-scale-out) and a gateway that knows which."""
    render = await stack.render()
    prefill = await stack.engine("prefill", engine("prefill", api=engines))
    decode = await stack.engine("decode", engine("decode", api=engines))
    endpoints = {"render": [ep(render)], "prefill": [ep(prefill)], "decode": [ep(decode)]}
    config = routing(endpoints=endpoints)
    config["tokensEngines"] = "tokens_only" if engines == "tokens" else "scale_out"
    return await stack.gateway(config)


def render_calls(stack: Stack) -> float:
    return sum(
        sample.value
        for render in stack.renders
        for metric in render.metrics.requests.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


async def test_tokens_only_engines_get_no_request_they_cannot_serve(stack: Stack) -> None:
    client = await render_stack(stack, "tokens")
    for chat, changes, param in NEEDS_A_TOKENIZER:
        path, body = body_of(chat, changes)
        for stream in (False, True):
            response = await client.post(path, json={**body, "stream": stream})
            assert response.status_code == 400, (changes, response.text)
            error = response.json()["error"]
            assert (error["param"], error["type"]) == (param, "BadRequestError"), changes
            message = error["message"]
            assert message.startswith(f"{param} is not available on this model: its engines ")
            assert "run --tokens-only (spec.render.engineApi: TokensOnly), which cannot " in message
            assert message.endswith(", or set spec.render.engineApi: ScaleOut"), message
    assert render_calls(stack) == 0  # refused before any render (or engine) work
    assert not any(server.core.steps for server in stack.engines.values())


async def test_the_refusal_says_what_to_send_instead(stack: Stack) -> None:
    client = await render_stack(stack, "tokens")
    response = await client.post("/v1/chat/completions", json={**PLAIN, "stop": ["\n"]})
    assert response.json()["error"]["message"] == (
        "stop is not available on this model: its engines run --tokens-only "
        "(spec.render.engineApi: TokensOnly), which cannot apply stop strings; use "
        "stop_token_ids, or set spec.render.engineApi: ScaleOut"
    )


@pytest.mark.parametrize("engines", ["tokens", "scale_out"])
async def test_both_serve_requests_that_need_no_tokenizer(stack: Stack, engines: str) -> None:
    client = await render_stack(stack, engines)
    for chat, changes in SERVED_BY_BOTH:
        path, body = body_of(chat, changes)
        response = await client.post(path, json=body)
        assert response.status_code == 200, (changes, response.text)


async def test_scale_out_engines_serve_the_whole_api(stack: Stack) -> None:
    client = await render_stack(stack, "scale_out")
    for chat, changes, _ in NEEDS_A_TOKENIZER:
        path, body = body_of(chat, changes)
        for stream in (False, True):
            response = await client.post(path, json={**body, "stream": stream})
            assert response.status_code == 200, (changes, response.text)


async def test_scale_out_engines_apply_stop_strings(stack: Stack) -> None:
    client = await render_stack(stack, "scale_out")
    body = {**PLAIN, "max_tokens": 200, "seed": 3}
    whole = (await client.post("/v1/chat/completions", json=body)).json()
    message = whole["choices"][0]["message"]
    words = (message.get("content") or message.get("reasoning") or "").split()
    assert len(words) > 4, message
    stop = words[len(words) // 2]
    stopped = (await client.post("/v1/chat/completions", json={**body, "stop": [stop]})).json()
    [choice] = stopped["choices"]
    assert choice["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < whole["usage"]["completion_tokens"]
