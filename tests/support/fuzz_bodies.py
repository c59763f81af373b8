"""Hypothesis strategies for OpenAI chat and completions request bodies as the input fuzzers
draw them: JSON values, vLLM's extras and unknown fields, and valid requests with random
optional parameters (tests/sim/gateway/adversarial/test_fuzz_*.py)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from pdserve.gateway.openai_schema import ChatRequest, CompletionRequest
from tests.support.fuzz_gateway import CAP, CHAT, COMPLETIONS
from tests.support.gateway_fakes import MODEL

# ---- strategies ----------------------------------------------------------------------------------

text = st.text(max_size=30)
json_leaf = st.none() | st.booleans() | st.integers() | st.floats() | text
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
KNOWN = set(ChatRequest.model_fields) | set(CompletionRequest.model_fields)
extras = st.dictionaries(text.filter(lambda k: k not in KNOWN), json_value, max_size=2)
unit = st.floats(0, 1)
TOOL = {"type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}}}  # fmt: skip

SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL) | st.none(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {}, optional={"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "max_tokens": st.integers(1, CAP) | st.none(),
    "n": st.integers(1, 4),
    "best_of": st.integers(0, 2),  # added to n (best_of >= n)
    "temperature": st.floats(0, 2) | st.integers(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 100),
    "min_p": unit,
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 2),
    "seed": st.integers(-(2**63), 2**64),
    "stop": text | st.lists(text, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 10**6), max_size=3),
    "logit_bias": st.dictionaries(st.integers(0, 10**5).map(str), st.floats(-100, 100), max_size=3),
    "user": text,
    "min_tokens": st.integers(0, 16),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "prompt_logprobs": st.integers(-1, 3),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "priority": st.integers(-10, 10),
    "conversation_id": text | st.integers(),
}
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
        "content": text
        | st.none()
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2),
    },
    optional={"name": text, "tool_call_id": text},
)
CHAT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **SAMPLING,
    "max_completion_tokens": st.integers(1, CAP),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),  # > 0: logprobs set true
    "tools": st.lists(st.just(TOOL), max_size=2),
    "tool_choice": st.sampled_from(
        ["none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
    ),
    "parallel_tool_calls": st.booleans(),
    "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()}),
    "add_generation_prompt": st.booleans(),
    "reasoning_effort": st.sampled_from(["low", "medium", "high"]),
}
COMPLETION_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    **SAMPLING,
    "suffix": text,
    "echo": st.booleans(),
    "logprobs": st.integers(0, 5),
}


def _consistent(body: dict[str, Any]) -> dict[str, Any]:
    if "best_of" in body:
        body["best_of"] += body.get("n", 1)
    if body.get("top_logprobs", 0) > 0:
        body["logprobs"] = True
    return body


_ids = st.integers(0, 50_000)
REQUIRED: dict[bool, dict[str, st.SearchStrategy[Any]]] = {  # chat or not: the prompt's field
    True: {"messages": st.lists(message, min_size=1, max_size=3)},
    False: {"prompt": st.one_of(text, st.lists(text, min_size=1, max_size=2),
                                st.lists(_ids, min_size=1, max_size=4),
                                st.lists(st.lists(_ids, min_size=1, max_size=3), min_size=1,
                                         max_size=2))},
}  # fmt: skip


@st.composite
def valid_request(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    chat = draw(st.booleans())
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    body = draw(st.fixed_dictionaries(REQUIRED[chat], optional=fields))
    body = {**draw(extras), **_consistent(body)}
    return (CHAT if chat else COMPLETIONS), body


# What the data plane proves valid and serves itself (dataplane/validate.go): the model named,
# max_tokens within the cap, and no parameter only the Python gateway checks. Most bodies
# valid_request draws set one of those and are handed to the Python gateway; these reach the
# data plane's own validation and route, which the invalid field of test_fuzz_input then tests.
PLAIN_SKIPS = {"model", "max_tokens", "logit_bias", "response_format", "tool_choice"}
PLAIN_CHAT = {k: v for k, v in CHAT_FIELDS.items() if k not in PLAIN_SKIPS}
PLAIN_COMPLETION = {k: v for k, v in COMPLETION_FIELDS.items() if k not in PLAIN_SKIPS}
PLAIN_CHAT["tool_choice"] = st.sampled_from(["none", "auto", "required"])


@st.composite
def plain_request(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid body as the data plane serves it: few optional parameters, all of its own."""
    chat = draw(st.booleans())
    fields = PLAIN_CHAT if chat else PLAIN_COMPLETION
    plain = draw(st.fixed_dictionaries(REQUIRED[chat]))
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True))
    plain.update({k: draw(fields[k]) for k in chosen}, model=MODEL)
    plain["max_tokens"] = draw(st.integers(1, CAP))
    return (CHAT if chat else COMPLETIONS), _consistent(plain)


def request_body() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """A valid body, half of them plain ones (the data plane's own)."""
    return valid_request() | plain_request()


def encoded(body: Any, ascii_only: bool) -> bytes:
    return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


JSON_HEADERS = {"Content-Type": "application/json"}
