"""The simulated render server speaks vLLM's render/derender contract: field names, shapes,
streaming state, the 400s, and parsers that split content / reasoning / tool_calls."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from pdserve.sim.chat import BUILTIN_TEMPLATES
from pdserve.sim.render_server import RenderConfig, RenderServer
from pdserve.sim.tokenizer import SimTokenizer
from tests.support.serving import serving

TOKENIZER = SimTokenizer()
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}]  # fmt: skip
CHAT = {"model": "qwen", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": TOOLS, "tool_choice": "auto", "max_tokens": 64}  # fmt: skip
OUTPUT = ('<think>\nthe user wants the weather\n</think>\n\n'
          '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>')  # fmt: skip
GENERATE_REQUEST_FIELDS = {"request_id", "token_ids", "features", "sampling_params", "model",
                           "stream", "stream_options", "cache_salt", "priority"}  # fmt: skip


def config(**overrides: Any) -> RenderConfig:
    base: dict[str, Any] = {"model": "Qwen/Qwen3-8B", "served_model_name": "qwen",
                            "max_model_len": 4096, "reasoning_parser": "qwen3",
                            "tool_call_parser": "hermes", "enable_auto_tool_choice": True}  # fmt: skip
    return RenderConfig(**{**base, **overrides})


@pytest.fixture
async def render() -> AsyncIterator[httpx.AsyncClient]:
    async with (
        serving(RenderServer(config()).app()) as url,
        httpx.AsyncClient(base_url=url) as client,
    ):
        yield client


async def test_chat_render_returns_a_generate_request(render: httpx.AsyncClient) -> None:
    response = await render.post("/v1/chat/completions/render", json=CHAT)
    assert response.status_code == 200, response.text
    generate = response.json()
    assert set(generate) == GENERATE_REQUEST_FIELDS
    assert generate["request_id"].startswith("chatcmpl-")
    assert generate["model"] == "qwen"
    assert generate["features"] is None
    prompt = TOKENIZER.decode(generate["token_ids"])
    assert prompt.startswith("<|im_start|>system\n")
    assert '"name": "get_weather"' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert generate["sampling_params"]["max_tokens"] == 64
    assert generate["sampling_params"]["n"] == 1


async def test_max_tokens_defaults_to_the_room_left_in_the_context(
    render: httpx.AsyncClient,
) -> None:
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    generate = (await render.post("/v1/chat/completions/render", json=body)).json()
    assert generate["sampling_params"]["max_tokens"] == 4096 - len(generate["token_ids"])


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_a_limit_of_16_is_left_out_as_vllm_leaves_out_sampling_defaults(
    render: httpx.AsyncClient, field: str
) -> None:
    """vLLM's SamplingParams serialise without the fields equal to their defaults (16 for
    max_tokens): the gateway must not lose the limit on the way to the engine."""
    body = {**{k: v for k, v in CHAT.items() if k != "max_tokens"}, field: 16}
    generate = (await render.post("/v1/chat/completions/render", json=body)).json()
    assert "max_tokens" not in generate["sampling_params"]
    generate = (await render.post("/v1/chat/completions/render", json={**body, field: 17})).json()
    assert generate["sampling_params"]["max_tokens"] == 17


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.mark.parametrize(
    ("changes", "constraint"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
         {"json": SCHEMA}),
        ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
        ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
         {"json": SCHEMA}),
    ],
)  # fmt: skip
async def test_output_constraints_become_the_sampling_params_structured_outputs(
    render: httpx.AsyncClient, changes: dict[str, Any], constraint: dict[str, Any] | None
) -> None:
    """What a --tokens-only engine refuses (it has no tokenizer to constrain with)."""
    response = await render.post("/v1/chat/completions/render", json={**CHAT, **changes})
    assert response.status_code == 200, response.text
    assert response.json()["sampling_params"]["structured_outputs"] == constraint


async def test_a_required_tool_call_is_constrained_to_a_list_of_calls(
    render: httpx.AsyncClient,
) -> None:
    body = {**CHAT, "tool_choice": "required"}
    params = (await render.post("/v1/chat/completions/render", json=body)).json()["sampling_params"]
    schema = params["structured_outputs"]["json"]
    assert (schema["type"], schema["minItems"]) == ("array", 1)
    [call] = schema["items"]["anyOf"]
    assert call["properties"]["name"] == {"const": "get_weather"}


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({**CHAT, "max_tokens": 5000}, 400, "This model's maximum context length is 4096 tokens."),
        ({**CHAT, "model": "other"}, 404, "The model `other` does not exist."),
        ({**CHAT, "use_beam_search": True}, 400, "beam search is not supported"),
        ({**CHAT, "messages": []}, 400, "messages: must be a non-empty list"),
        ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ],
)
async def test_render_errors_match_vllm(
    render: httpx.AsyncClient, body: dict[str, Any], status: int, message: str
) -> None:
    response = await render.post("/v1/chat/completions/render", json=body)
    assert response.status_code == status
    assert response.json()["error"]["message"].startswith(message)


async def test_completions_render_returns_a_list(render: httpx.AsyncClient) -> None:
    response = await render.post("/v1/completions/render",
                                 json={"model": "qwen", "prompt": ["hello world", "the cache"], "max_tokens": 8})  # fmt: skip
    generates = response.json()
    assert isinstance(generates, list)
    assert [TOKENIZER.decode(g["token_ids"]) for g in generates] == ["hello world", "the cache"]
    assert all(g["request_id"].startswith("cmpl-") for g in generates)


def derender_body(ids: list[int], *, chat_request: dict[str, Any] | None) -> dict[str, Any]:
    return {"stream": False, "model": "qwen", "prompt_tokens": 30, "prompt_token_ids": [1] * 30,
            "chat_request": chat_request,
            "generate_response": {"request_id": "chatcmpl-x", "choices": [
                {"index": 0, "token_ids": ids, "finish_reason": "stop", "logprobs": None}]}}  # fmt: skip


async def test_derender_splits_reasoning_and_tool_calls(render: httpx.AsyncClient) -> None:
    ids = TOKENIZER.encode(OUTPUT)
    response = await render.post(
        "/v1/chat/completions/derender", json=derender_body(ids, chat_request=CHAT)
    )
    answer = response.json()
    assert answer["object"] == "chat.completion"
    assert answer["id"] == "chatcmpl-x"
    [choice] = answer["choices"]
    message = choice["message"]
    # As vLLM 0.32 splits it: nothing stripped, the text before the call is the content.
    assert message["content"] == "\n\n"
    assert message["reasoning"] == "\nthe user wants the weather\n"
    assert "reasoning_content" not in message  # vLLM 0.32 sends `reasoning` only
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["type"] == "function"
    assert call["id"].startswith("chatcmpl-tool-")
    # vLLM 0.32's whole-answer derender keeps "stop" (the gateway says "tool_calls").
    assert choice["finish_reason"] == "stop"
    assert answer["usage"] == {
        "prompt_tokens": 30,
        "completion_tokens": len(ids),
        "total_tokens": 30 + len(ids),
    }


async def test_derender_without_chat_request_leaves_markup_in_content(
    render: httpx.AsyncClient,
) -> None:
    ids = TOKENIZER.encode(OUTPUT)
    answer = (await render.post("/v1/chat/completions/derender",
                                json=derender_body(ids, chat_request=None))).json()  # fmt: skip
    content = answer["choices"][0]["message"]["content"]
    assert "<think>" in content
    assert "<tool_call>" in content


async def stream(
    render: httpx.AsyncClient, ids: list[int], *, per_call: int
) -> list[dict[str, Any]]:
    chunks, state = [], None
    for start in range(0, len(ids), per_call):
        last = start + per_call >= len(ids)
        body = {"stream": True, "model": "qwen", "prompt_tokens": 30, "prompt_token_ids": [1] * 30,
                "chat_request": CHAT, "stream_state": state,
                "generate_chunk": {"request_id": "chatcmpl-x", "choices": [{
                    "index": 0, "token_ids": ids[start:start + per_call],
                    "finish_reason": "stop" if last else None, "logprobs": None}]}}  # fmt: skip
        response = await render.post("/v1/chat/completions/derender", json=body)
        assert response.status_code == 200, response.text
        result = response.json()
        chunks.append(result["chunk"])
        state = result["stream_state"]
    return chunks


@pytest.mark.parametrize("per_call", [1, 3, 1000])
async def test_streaming_derender_deltas_add_up_to_the_full_answer(
    render: httpx.AsyncClient, per_call: int
) -> None:
    ids = TOKENIZER.encode(
        "<think>\nfirst step then answer\n</think>\n\nIt is sunny in Paris.<|im_end|>"
    )
    chunks = await stream(render, ids, per_call=per_call)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert all("role" not in d for d in deltas[1:])
    # vLLM 0.32's derender decodes the stop token into the content, as this one does: the
    # gateway drops it before derender (pdserve/vllm/derender_gaps.py).
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "\n\nIt is sunny in Paris.<|im_end|>"
    assert "".join(d.get("reasoning", "") for d in deltas) == "\nfirst step then answer\n"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_streamed_tool_call_is_sent_once_with_its_index(render: httpx.AsyncClient) -> None:
    chunks = await stream(render, TOKENIZER.encode(OUTPUT), per_call=2)
    calls = [call for c in chunks for call in c["choices"][0]["delta"].get("tool_calls", [])]
    assert len(calls) == 1
    assert calls[0]["index"] == 0
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all("<tool_call>" not in c["choices"][0]["delta"].get("content", "") for c in chunks)


@pytest.mark.parametrize(
    ("change", "message"),
    [({"chat_request": None}, "needs chat_request and prompt_token_ids"),
     ({"prompt_token_ids": None}, "needs chat_request and prompt_token_ids"),
     ({"generate_chunk": {"choices": [{"index": 0, "token_ids": [1]}, {"index": 1, "token_ids": [2]}]}},
      "one choice per chunk")],
)  # fmt: skip
async def test_streaming_derender_400s(
    render: httpx.AsyncClient, change: dict[str, Any], message: str
) -> None:
    body = {"stream": True, "model": "qwen", "prompt_tokens": 1, "prompt_token_ids": [1],
            "chat_request": CHAT, "stream_state": None,
            "generate_chunk": {"choices": [{"index": 0, "token_ids": [1]}]}, **change}  # fmt: skip
    response = await render.post("/v1/chat/completions/derender", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


async def test_different_templates_give_different_prompts() -> None:
    conversation = {**CHAT, "messages": [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "<think>\nlet me think\n</think>\n\nhello there"},
        {"role": "user", "content": "and then"},
    ]}  # fmt: skip
    prompts = []
    for template in ("qwen3", "chatml"):
        server = RenderServer(config(chat_template=BUILTIN_TEMPLATES[template]))
        async with serving(server.app()) as url, httpx.AsyncClient(base_url=url) as client:
            prompts.append(
                (await client.post("/v1/chat/completions/render", json=conversation)).json()[
                    "token_ids"
                ]
            )
    assert prompts[0] != prompts[1]
    assert "let me think" not in TOKENIZER.decode(prompts[0])  # qwen3 strips reasoning history
    assert "let me think" in TOKENIZER.decode(prompts[1])


async def test_parser_load_metrics_count_calls_streams_and_cpu(render: httpx.AsyncClient) -> None:
    await stream(render, TOKENIZER.encode("<think>\nx\n</think>\n\ny"), per_call=1)
    text = (await render.get("/metrics")).text
    metrics = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}  # fmt: skip
    calls = metrics['pdserve_sim_render_derender_calls_total{stream="true"}']
    assert calls == len(TOKENIZER.encode("<think>\nx\n</think>\n\ny"))
    assert metrics["pdserve_sim_render_derender_streams_total"] == 1
    assert metrics["pdserve_sim_render_parse_cpu_seconds_total"] > 0
    # What a real render server exposes and the autoscalers read: HTTP time per handler (as
    # prometheus-fastapi-instrumentator names it) and the process's CPU.
    handler = '{handler="/v1/chat/completions/derender",method="POST"}'
    assert metrics[f"http_request_duration_seconds_count{handler}"] == calls
    assert metrics[f"http_request_duration_seconds_sum{handler}"] > 0
    ok = '{handler="/v1/chat/completions/derender",method="POST",status="2xx"}'
    assert metrics[f"http_requests_total{ok}"] == calls
    assert metrics["process_cpu_seconds_total"] > 0


async def test_health_and_models(render: httpx.AsyncClient) -> None:
    assert (await render.get("/health")).status_code == 200
    [model] = (await render.get("/v1/models")).json()["data"]
    assert (model["id"], model["root"], model["max_model_len"]) == ("qwen", "Qwen/Qwen3-8B", 4096)
