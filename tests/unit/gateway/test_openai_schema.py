"""The OpenAI request schema at the gateway's boundary: a bad value gets a 400 naming its field
before any render server or engine is called; valid bodies, vLLM's extras included, go
upstream as the client sent them; what only an engine with a tokenizer serves is refused when
the engines run --tokens-only."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pdserve.gateway.errors import GatewayError
from pdserve.gateway.intake import Intake
from pdserve.gateway.openai_schema import InvalidRequest, needs_tokenizer, validate_request
from pdserve.gateway.settings import GatewaySettings
from tests.support.gateway_fakes import FakeUpstream, fake_gateway

CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
PROMPT: dict[str, Any] = {"prompt": "once upon a time", "max_tokens": 5}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (chat?, the fields changed, the param named, the start of the message)
REFUSED: list[tuple[bool, dict[str, Any], str, str]] = [
    # The examples.
    (True, {"best_of": -1}, "best_of", "best_of must be a positive integer"),
    (False, {"best_of": -1}, "best_of", "best_of must be a positive integer"),
    (True, {"logprobs": "abc"}, "logprobs", "logprobs must be true or false"),
    (False, {"logprobs": "abc"}, "logprobs", "logprobs must be an integer"),
    (True, {"temperature": "hot"}, "temperature", "temperature must be a non-negative number"),
    (True, {"stream_options": "yes"}, "stream_options", "stream_options must be an object"),
    (True, {"stream_options": ["x"]}, "stream_options", "stream_options must be an object"),
    # The checks the gateway made by hand before (their words kept).
    (True, {"max_tokens": 0}, "max_tokens", "max_tokens must be a positive integer"),
    (True, {"max_tokens": "5"}, "max_tokens", "max_tokens must be a positive integer"),
    (True, {"max_tokens": True}, "max_tokens", "max_tokens must be a positive integer"),
    (True, {"max_completion_tokens": 2.5}, "max_completion_tokens", "max_completion_tokens must"),
    (True, {"n": 0}, "n", "n must be a positive integer"),
    (True, {"stream": "yes"}, "stream", "stream must be true or false"),
    (True, {"stream": 1}, "stream", "stream must be true or false"),
    # Sampling.
    (True, {"temperature": -0.5}, "temperature", "temperature must be a non-negative number"),
    (True, {"temperature": True}, "temperature", "temperature must be"),
    (True, {"top_p": 0}, "top_p", "top_p must be a number in (0, 1]"),
    (True, {"top_p": 1.5}, "top_p", "top_p must be"),
    (True, {"top_k": -2}, "top_k", "top_k must be an integer"),
    (True, {"top_k": 1.5}, "top_k", "top_k must be an integer"),
    (True, {"min_p": 2}, "min_p", "min_p must be a number from 0 to 1"),
    (True, {"presence_penalty": 3}, "presence_penalty", "presence_penalty must be a number"),
    (True, {"frequency_penalty": "x"}, "frequency_penalty", "frequency_penalty must be"),
    (True, {"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be"),
    (True, {"seed": "42"}, "seed", "seed must be an integer"),
    (True, {"stop": 5}, "stop", "stop must be a string or a list of strings"),
    (True, {"stop": ["a", 1]}, "stop", "stop must be a string or a list of strings"),
    (True, {"stop_token_ids": [1, "2"]}, "stop_token_ids", "stop_token_ids must be a list"),
    (True, {"min_tokens": -1}, "min_tokens", "min_tokens must be a non-negative integer"),
    (True, {"ignore_eos": "no"}, "ignore_eos", "ignore_eos must be true or false"),
    (True, {"logit_bias": {"1": "up"}}, "logit_bias", "logit_bias must be an object"),
    (True, {"user": 7}, "user", "user must be a string"),
    (True, {"n": 2, "best_of": 1}, "best_of", "best_of must be at least n"),
    (True, {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    (True, {"top_logprobs": "2"}, "top_logprobs", "top_logprobs must be an integer"),
    (True, {"prompt_logprobs": -2}, "prompt_logprobs", "prompt_logprobs must be an integer"),
    (True, {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", ""),
    # NaN and infinities: Python's JSON parser reads them, no engine can use them.
    (True, {"temperature": float("nan")}, "temperature", "temperature must be"),
    (True, {"top_p": float("inf")}, "top_p", "top_p must be"),
    # Messages, tools, formats.
    (True, {"messages": []}, "messages", "messages: must be a non-empty list"),
    (True, {"messages": "hi"}, "messages", "messages: must be a non-empty list"),
    (True, {"messages": [5]}, "messages[0]", "messages[0] must be an object"),
    (True, {"messages": [{"content": "x"}]}, "messages[0].role", "messages[0].role is required"),
    (True, {"messages": [{"role": 1}]}, "messages[0].role", "messages[0].role must be a string"),
    (True, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", ""),
    (True, {"tools": {"type": "function"}}, "tools", "tools must be a list of tools"),
    (True, {"tools": [{"type": "function"}]}, "tools[0].function", "tools[0].function is"),
    (True, {"tools": [{"function": {"name": 3}}]}, "tools[0].function.name", ""),
    (True, {"tools": [TOOL], "tool_choice": "maybe"}, "tool_choice", "tool_choice must be"),
    (True, {"tool_choice": {"type": "function"}}, "tool_choice", "tool_choice must be"),
    (True, {"stop": [["a"]]}, "stop", "stop must be a string or a list of strings"),
    (True, {"response_format": "json"}, "response_format", "response_format must be an object"),
    (True, {"response_format": {}}, "response_format.type", "response_format.type is required"),
    (True, {"chat_template_kwargs": []}, "chat_template_kwargs", "chat_template_kwargs must"),
    (True, {"parallel_tool_calls": "yes"}, "parallel_tool_calls", "parallel_tool_calls must"),
    # Completions.
    (False, {"prompt": None}, "prompt", "prompt is required"),
    (False, {"prompt": 5}, "prompt", "prompt must be a string, a list of strings, or token ids"),
    (False, {"prompt": [1, "a"]}, "prompt", "prompt must be"),
    (False, {"echo": "yes"}, "echo", "echo must be true or false"),
    (False, {"suffix": 1}, "suffix", "suffix must be a string"),
]

ACCEPTED: list[tuple[bool, dict[str, Any]]] = [
    (True, {}),
    (True, {"max_tokens": None, "stream": False, "temperature": 0, "top_p": 1, "seed": -3}),
    (True, {"temperature": 0.7, "top_k": -1, "min_p": 0.05, "repetition_penalty": 1.1}),
    (True, {"stop": "\n", "stop_token_ids": [7], "logit_bias": {"7": -100}, "user": "u"}),
    (True, {"n": 2, "best_of": 3, "presence_penalty": -2, "frequency_penalty": 2}),
    (True, {"stream": True, "stream_options": {"include_usage": True, "new_option": 1}}),
    (True, {"logprobs": True, "top_logprobs": 5}),
    (True, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    (True, {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}),
    (True, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
    # vLLM's extras and unknown parameters go through untouched.
    (True, {"chat_template_kwargs": {"enable_thinking": False}, "min_tokens": 2}),
    (True, {"ignore_eos": True, "skip_special_tokens": False, "priority": 1}),
    (True, {"guided_json": {"type": "object"}, "some_future_option": [1, {"a": None}]}),
    (True, {"conversation_id": "c-1", "max_completion_tokens": 9}),
    (
        True,
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
                {"role": "tool", "tool_call_id": "1", "content": "sunny"},
            ]
        },
    ),
    (False, {}),
    (False, {"prompt": ["a", "b"], "logprobs": 0, "echo": True, "suffix": "!"}),
    (False, {"prompt": [1, 2, 3], "best_of": 2, "n": 2}),
    (False, {"prompt": [[1, 2], [3]], "prompt_logprobs": 1}),
    (False, {"prompt": None, "prompt_embeds": "<base64>"}),
]


@pytest.fixture
async def served() -> AsyncIterator[tuple[TestClient[Any, Any], FakeUpstream]]:
    gateway, upstream = fake_gateway("tokens", "Aggregated")
    async with TestClient(TestServer(gateway.app())) as client:
        yield client, upstream


def body_of(chat: bool, changes: dict[str, Any]) -> dict[str, Any]:
    return {**(CHAT if chat else PROMPT), **changes}


@pytest.mark.parametrize(("chat", "changes", "param", "message"), REFUSED)
async def test_a_bad_value_is_refused_naming_its_field_before_any_upstream_call(
    served: tuple[TestClient[Any, Any], FakeUpstream],
    chat: bool,
    changes: dict[str, Any],
    param: str,
    message: str,
) -> None:
    client, upstream = served
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = await client.post(
        path,
        data=json.dumps(body_of(chat, changes)),  # NaN stays NaN, as a client may send it
        headers={"Content-Type": "application/json"},
    )
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == param
    assert error["message"].startswith(message or param)
    assert error["type"] == "BadRequestError"
    assert error["code"] == 400
    assert upstream.calls == []


@pytest.mark.parametrize(("chat", "changes"), ACCEPTED)
def test_valid_bodies_and_vllms_extras_pass(chat: bool, changes: dict[str, Any]) -> None:
    validate_request(body_of(chat, changes), chat=chat)


@pytest.mark.parametrize(("chat", "changes", "param", "message"), REFUSED)
def test_the_schema_alone_refuses_the_same(
    chat: bool, changes: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        validate_request(body_of(chat, changes), chat=chat)
    assert refused.value.param == param


async def test_a_valid_body_goes_to_render_as_the_client_sent_it(
    served: tuple[TestClient[Any, Any], FakeUpstream],
) -> None:
    client, upstream = served
    body = {
        **CHAT,
        "model": "qwen",
        "temperature": 1,  # an int stays an int (the model reads it as a float)
        "chat_template_kwargs": {"enable_thinking": False},
        "stop": ["\n"],
        "unknown_extra": {"kept": [1, 2]},
    }
    upstream.script = {"render": [RuntimeError("stop after render")]}
    await client.post("/v1/chat/completions", json=body)
    [sent] = upstream.sent("render")
    assert sent == body
    assert json.dumps(sent) == json.dumps(body)  # same keys, same order, same types


@pytest.mark.parametrize(
    ("chat", "changes", "param"),
    [
        (True, {"logprobs": True}, "logprobs"),
        (True, {"logprobs": True, "top_logprobs": 3}, "logprobs"),
        (False, {"logprobs": 0}, "logprobs"),
        (True, {"prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
async def test_streamed_logprobs_are_refused_where_derender_would_drop_them(
    served: tuple[TestClient[Any, Any], FakeUpstream],
    chat: bool,
    changes: dict[str, Any],
    param: str,
) -> None:
    client, upstream = served
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = await client.post(path, json={**body_of(chat, changes), "stream": True})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["param"] == param
    assert f"{param} is not available with stream: true" in error["message"]
    assert upstream.calls == []


async def test_logprobs_unstreamed_or_without_them_go_to_render(
    served: tuple[TestClient[Any, Any], FakeUpstream],
) -> None:
    client, upstream = served
    for body in ({**CHAT, "logprobs": True}, {**CHAT, "stream": True, "logprobs": False}):
        upstream.script = {"render": [RuntimeError("stop after render")]}
        await client.post("/v1/chat/completions", json=body)
    assert [sent["logprobs"] for sent in upstream.sent("render")] == [True, False]


async def test_openai_engines_stream_logprobs_through() -> None:
    gateway, upstream = fake_gateway("openai", "Aggregated")
    event = {"choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": {"content": []}}]}
    upstream.stream_lines = [f"data: {json.dumps(event)}\n".encode(), b"data: [DONE]\n"]
    async with TestClient(TestServer(gateway.app())) as client:
        body = {**CHAT, "stream": True, "logprobs": True, "top_logprobs": 2}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status == 200
        text = await response.text()
    [sent] = upstream.sent("decode_stream")
    assert sent["logprobs"] is True
    assert sent["top_logprobs"] == 2
    assert json.loads(text.splitlines()[0].removeprefix("data: ")) == event


# ---- what only an engine with a tokenizer serves -------------------------------------------------
@pytest.mark.parametrize(
    ("chat", "changes", "param"),
    [
        (True, {"stop": "\n"}, "stop"),
        (True, {"stop": ""}, "stop"),
        (True, {"stop": ["a"]}, "stop"),
        (False, {"stop": ["a"]}, "stop"),
        (True, {"stop": []}, None),
        (True, {"stop": None}, None),
        (True, {"stop_token_ids": [7]}, None),
        (True, {"response_format": {"type": "json_object"}}, "response_format"),
        (True, {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        (True, {"response_format": {"type": "structural_tag"}}, "response_format"),
        (False, {"response_format": {"type": "json_object"}}, "response_format"),
        (True, {"response_format": {"type": "text"}}, None),
        (True, {"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
        (False, {"guided_json": {"type": "object"}}, "guided_json"),
        (True, {"guided_regex": "a+"}, "guided_regex"),
        (True, {"guided_choice": ["a"]}, "guided_choice"),
        (True, {"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
        (True, {"guided_json": None}, None),
        (True, {"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
        (True, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tool_choice"),
        (True, {"tools": [TOOL], "tool_choice": "auto"}, None),
        (True, {"tools": [TOOL], "tool_choice": "none"}, None),
        (True, {}, None),
    ],
)  # fmt: skip
def test_what_needs_a_tokenizer_on_the_engine(
    chat: bool, changes: dict[str, Any], param: str | None
) -> None:
    found = needs_tokenizer(validate_request(body_of(chat, changes), chat=chat))
    assert (None if found is None else found.param) == param


def test_intake_refuses_them_only_when_the_engines_run_tokens_only() -> None:
    body = {**CHAT, "model": "m", "stop": ["\n"]}
    assert Intake("m", GatewaySettings()).check_body(dict(body), chat=True)["stop"] == ["\n"]
    with pytest.raises(GatewayError) as refused:
        Intake("m", GatewaySettings(), tokens_only_engines=True).check_body(dict(body), chat=True)
    assert (refused.value.status, refused.value.param) == (400, "stop")
    assert "use stop_token_ids, or set spec.render.engineApi: ScaleOut" in refused.value.message


async def test_a_tokens_only_models_gateway_refuses_before_render() -> None:
    gateway, upstream = fake_gateway(tokens_engines="tokens_only")
    async with TestClient(TestServer(gateway.app())) as client:
        response = await client.post("/v1/chat/completions", json={**CHAT, "stop": "\n"})
        assert response.status == 400
        assert (await response.json())["error"]["param"] == "stop"
    assert upstream.calls == []
