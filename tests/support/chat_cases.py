"""The chat requests the real-vLLM suites (tests/vllm) send every route: one per feature the
OpenAI API has and a route could lose (reasoning on and off, tools auto / required / named, stop
strings, structured outputs, n > 1, logprobs, the length limit), greedy unless sampling is the
point, so two servers must answer token for token."""

from __future__ import annotations

from typing import Any

from tests.support.real_vllm import SERVED_NAME

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = [{"role": "user", "content": "What is the answer?"}]
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"answer": {"type": "integer"}},
            "required": ["answer"],
        },
    },
}

CHAT_CASES: dict[str, dict[str, Any]] = {
    "reasoning": {"messages": ANSWER},
    "reasoning-off": {
        "messages": ANSWER,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    },
    "tools-auto": {"messages": WEATHER, "tools": TOOLS, "tool_choice": "auto"},
    "tools-required": {"messages": WEATHER, "tools": TOOLS, "tool_choice": "required"},
    "tools-named": {
        "messages": WEATHER,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
    "stop-string": {"messages": ANSWER, "stop": ["forty"]},
    "structured-output": {"messages": ANSWER, "response_format": SCHEMA, "max_tokens": 40},
    # vLLM refuses n > 1 with greedy sampling: seeded sampling is as reproducible.
    "n-2": {"messages": ANSWER, "n": 2, "temperature": 0.8, "seed": 7},
    "logprobs": {"messages": ANSWER, "logprobs": True, "top_logprobs": 2},
    "length": {"messages": ANSWER, "max_tokens": 5},
}
STREAM_CASES = ["reasoning", "reasoning-off", "tools-auto", "stop-string", "n-2", "length"]


def request(case: dict[str, Any]) -> dict[str, Any]:
    body = {"model": SERVED_NAME, "temperature": 0, "max_tokens": 60, **case}
    extra = {key: body.pop(key) for key in ("chat_template_kwargs",) if key in body}
    return {**body, "extra_body": {**body.get("extra_body", {}), **extra}}


def long_answer() -> dict[str, Any]:
    """A request that would generate 2,000 tokens (the stop token ignored): long enough that
    only an abort ends it early."""
    return {**request({"messages": ANSWER, "max_tokens": LONG_ANSWER_TOKENS}),
            "extra_body": {"ignore_eos": True}}  # fmt: skip


LONG_ANSWER_TOKENS = 2000  # with the prompt, within the engines' --max-model-len 2048
