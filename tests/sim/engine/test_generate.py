"""The simulated engine speaks vLLM's generate contract: deterministic answers shaped like
vLLM's, length control, one token per streamed event with usage and [DONE], refused token ids,
the OpenAI routes with reasoning and tool calls, and simulated token times on request."""

from __future__ import annotations

import itertools
import json

import pytest

from pdserve.sim.generation import ModelBehaviour
from pdserve.sim.render_server import RenderConfig
from tests.support.sim_engine import PROMPT, TOKENIZER, Engines, engine_config, generate_body


async def test_generate_is_deterministic_and_shaped_like_vllm(engines: Engines) -> None:
    _, client = await engines(engine_config())
    first = (await client.post("/inference/v1/generate", json=generate_body())).json()
    again = (
        await client.post("/inference/v1/generate", json=generate_body(request_id="req-2"))
    ).json()
    assert set(first) == {
        "request_id",
        "model",
        "created",
        "choices",
        "usage",
        "kv_transfer_params",
        "prompt_logprobs",
        "output_mode",
    }
    [choice] = first["choices"]
    assert set(choice) == {"index", "token_ids", "finish_reason", "logprobs"}
    assert choice["token_ids"] == again["choices"][0]["token_ids"]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"][-1] == TOKENIZER.im_end_token_id
    assert first["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(choice["token_ids"]),
        "total_tokens": len(PROMPT) + len(choice["token_ids"]),
    }
    assert first["kv_transfer_params"] is None


async def test_max_tokens_and_ignore_eos_control_the_length(engines: Engines) -> None:
    _, client = await engines(engine_config())
    short = (
        await client.post(
            "/inference/v1/generate",
            json=generate_body(sampling_params={"max_tokens": 3, "seed": 7}),
        )
    ).json()["choices"][0]
    assert (len(short["token_ids"]), short["finish_reason"]) == (3, "length")
    exact = (
        await client.post(
            "/inference/v1/generate",
            json=generate_body(sampling_params={"max_tokens": 256, "ignore_eos": True}),
        )
    ).json()["choices"][0]
    assert (len(exact["token_ids"]), exact["finish_reason"]) == (256, "length")


async def test_streaming_sends_one_token_per_event_usage_and_done(engines: Engines) -> None:
    _, client = await engines(engine_config())
    body = generate_body(
        stream=True,
        stream_options={"include_usage": True},
        sampling_params={"max_tokens": 5, "seed": 7},
    )
    async with client.stream("POST", "/inference/v1/generate", json=body) as response:
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    tokens = [e for e in events if e["choices"]]
    assert len(tokens) == 5
    assert all(len(e["choices"][0]["token_ids"]) == 1 for e in tokens)
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 5


async def test_bad_token_ids_are_refused_naming_the_position(engines: Engines) -> None:
    _, client = await engines(engine_config())
    response = await client.post(
        "/inference/v1/generate", json=generate_body(token_ids=[1, 2, 10**9])
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(
        "token_ids[2] = 1000000000 is not in the vocabulary"
    )


async def test_reasoning_and_tools_in_openai_mode(engines: Engines) -> None:
    render = RenderConfig(
        model="Qwen/Qwen3-8B",
        served_model_name="qwen",
        reasoning_parser="qwen3",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    _, client = await engines(
        engine_config(api="openai", render=render, behaviour=ModelBehaviour(reasoning=True))
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    body = {
        "model": "qwen",
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": tools,
        "tool_choice": "auto",
        "max_tokens": 300,
    }
    answer = (await client.post("/v1/chat/completions", json=body)).json()
    message = answer["choices"][0]["message"]
    assert message["reasoning"]
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert set(json.loads(message["tool_calls"][0]["function"]["arguments"])) == {"city"}
    assert answer["choices"][0]["finish_reason"] == "tool_calls"

    async with client.stream(
        "POST", "/v1/chat/completions", json={**body, "stream": True}
    ) as response:
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("reasoning", "") for c in chunks)
    assert streamed == message["reasoning"]


async def test_simulated_token_times_only_on_request(engines: Engines) -> None:
    _, client = await engines(engine_config())
    body = generate_body(stream=True, sampling_params={"max_tokens": 4, "seed": 1})
    for headers, expected in (({}, False), ({"X-PDServe-Sim-Timing": "1"}, True)):
        async with client.stream(
            "POST", "/inference/v1/generate", json=body, headers=headers
        ) as response:
            events = [
                json.loads(line.removeprefix("data: "))
                async for line in response.aiter_lines()
                if line.startswith("data: {")
            ]
        assert all(("sim_time" in e) is expected for e in events)
        if expected:
            times = [e["sim_time"] for e in events]
            assert times == sorted(times)
            gaps = [b - a for a, b in itertools.pairwise(times)]
            assert all(g == pytest.approx(0.0201, rel=1e-3) for g in gaps)  # one decode step each
