"""Fuzzing the gateway's request bodies (hypothesis, deterministic): bodies drawn from the OpenAI
chat and completions schemas, valid ones with random optional parameters, vLLM's extras and
unknown fields, plain ones the data plane serves itself, and the same with one field made invalid
(a wrong type, an out-of-range or huge number, NaN, a wrong nesting), against the whole gateway
on a loopback fake upstream, on both request paths (the Python gateway, the data plane).

Every answer is a 200 with a well-formed OpenAI body (or stream), or an OpenAI-shaped JSON
error with a 4xx: never text/plain, never a 5xx, never an upstream address; a body refused
never reaches the upstream, and an invalid field's 400 names it."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.fuzz_bodies import JSON_HEADERS, encoded, request_body, text
from tests.support.fuzz_gateway import CAP, CHAT, COMPLETIONS, FUZZ, Served, check
from tests.support.gateway_fakes import MODEL
from tests.support.outcomes import Outcome


@given(request=request_body(), ascii_only=st.booleans())
@settings(FUZZ, max_examples=150)
def test_valid_bodies_are_answered(
    served: Served, request: tuple[str, dict[str, Any]], ascii_only: bool
) -> None:
    path, body = request
    verdict = check(
        served, "valid bodies", served.post(path, encoded(body, ascii_only), JSON_HEADERS)
    )
    asks_logprobs = body.get("prompt_logprobs") is not None or (
        body.get("logprobs") if path == CHAT else body.get("logprobs") is not None
    )
    if body.get("stream") and asks_logprobs:
        # Behind render servers a stream cannot carry log probabilities: refused, by name.
        assert verdict.status == 400, verdict
        assert verdict.error is not None
        assert verdict.error["param"] in ("logprobs", "prompt_logprobs")
        return
    assert verdict.outcome is Outcome.ANSWERED, verdict
    assert verdict.streamed == bool(body.get("stream"))
    sent = served.upstream.sent("render")[0]
    assert {k: v for k, v in sent.items() if k != "max_tokens"} == {
        k: v for k, v in {**body, "model": MODEL}.items() if k != "max_tokens"
    }  # the body goes upstream as the client sent it (the cap's default filled in)


# ---- one field made invalid ----------------------------------------------------------------------

not_int = st.booleans() | st.floats() | text | st.lists(st.integers(), max_size=2)
not_number = (
    st.booleans()
    | text
    | st.lists(st.floats(), max_size=2)
    | st.sampled_from([float("nan"), float("inf"), float("-inf")])
)
not_bool = st.integers() | st.floats() | text | st.lists(st.booleans(), max_size=2)
not_str = st.integers() | st.booleans() | st.floats() | st.lists(text, max_size=2)
not_object = st.integers() | text | st.lists(st.integers(), max_size=2) | st.booleans()
huge = st.sampled_from([10**30, -(10**30), 1e308, -1e308, 1e400])  # 1e400: Infinity once parsed


def below(bound: float) -> st.SearchStrategy[float]:
    return st.floats(max_value=bound, exclude_max=True, allow_infinity=False)


def above(bound: float) -> st.SearchStrategy[float]:
    return st.floats(min_value=bound, exclude_min=True, allow_infinity=False)


INVALID_SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "stream": not_bool,
    "stream_options": not_object | st.just({"include_usage": "yes"}),
    "max_tokens": st.integers(max_value=0) | st.integers(min_value=CAP + 1) | not_int | huge,
    "n": st.integers(max_value=0) | not_int,
    "temperature": below(0) | not_number | st.just(-1e400),
    "top_p": st.just(0) | below(0) | above(1) | not_number | huge,
    "top_k": st.integers(max_value=-2) | not_int,
    "min_p": below(0) | above(1) | not_number,
    "presence_penalty": below(-2) | above(2) | not_number | huge,
    "frequency_penalty": below(-2) | above(2) | not_number,
    "repetition_penalty": st.floats(max_value=0, allow_infinity=False) | not_number,
    "seed": not_int,
    "stop": st.integers() | st.lists(st.integers(), min_size=1, max_size=2) | st.just({"a": 1}),
    "stop_token_ids": st.lists(st.floats() | text, min_size=1, max_size=2) | text | st.integers(),
    "logit_bias": st.lists(st.integers(), max_size=2) | st.just({"1": "x"}) | st.just({"1": []}),
    "user": not_str,
    "min_tokens": st.integers(max_value=-1) | not_int,
    "ignore_eos": not_bool,
    "skip_special_tokens": not_bool,
    "prompt_logprobs": st.integers(max_value=-2) | not_int,
    "response_format": not_object | st.just({}) | st.just({"type": 5}),
    "priority": not_int,
}
INVALID_CHAT: dict[str, st.SearchStrategy[Any]] = {
    **INVALID_SAMPLING,
    "messages": st.sampled_from(
        [
            [],
            "hi",
            [1],
            [None],
            [{}],
            [{"role": 5}],
            [{"content": "x"}],
            [{"role": "user", "content": 5}],
            [{"role": "user", "content": {"text": "x"}}],
            [{"role": "user", "content": "x", "tool_calls": "x"}],
            {"role": "user"},
        ]
    ),
    "max_completion_tokens": st.integers(max_value=0) | not_int | st.integers(min_value=CAP + 1),
    "logprobs": not_bool,
    "tools": not_object.filter(lambda v: not isinstance(v, list))
    | st.sampled_from(
        [[1], [{"function": 5}], [{"function": {"name": 5}}], [{"type": "function"}]]
    ),
    "tool_choice": st.sampled_from(["sometimes", 5, True, {"function": {}}, {"type": "function"}]),
    "chat_template_kwargs": not_object,
    "parallel_tool_calls": not_bool,
}
INVALID_COMPLETION: dict[str, st.SearchStrategy[Any]] = {
    **INVALID_SAMPLING,
    "prompt": st.sampled_from([5, True, {"text": "x"}, [1.5], [["a"]], [None], [[1, "a"]]]),
    "logprobs": st.integers(max_value=-2) | not_int,
    "suffix": not_str,
    "echo": not_bool,
}


@st.composite
def invalid_request(draw: st.DrawFn) -> tuple[str, dict[str, Any], str, int]:
    """A valid body with one thing wrong: (path, body, the param its error names, status)."""
    path, body = draw(request_body())
    fields = INVALID_CHAT if path == CHAT else INVALID_COMPLETION
    special = ["model", "best_of", "prompt_missing" if path == COMPLETIONS else "top_logprobs"]
    field = draw(st.sampled_from(sorted(fields) + special))
    if field == "model":
        body["model"] = draw(text.filter(lambda m: m != MODEL) | st.integers())
        return path, body, "model", 404
    if field == "best_of":  # fewer candidates than choices
        n = draw(st.integers(2, 5))
        body.update(n=n, best_of=draw(st.integers(1, n - 1)))
        return path, body, "best_of", 400
    if field == "top_logprobs":  # alternatives without logprobs
        body.pop("logprobs", None)
        body["top_logprobs"] = draw(st.integers(1, 20))
        return path, body, "top_logprobs", 400
    if field == "prompt_missing":
        del body["prompt"]
        return path, body, "prompt", 400
    body[field] = draw(fields[field])
    return path, body, field, 400


@given(request=invalid_request())
@settings(FUZZ, max_examples=250)
def test_an_invalid_field_is_a_400_naming_it_before_any_upstream_call(
    served: Served, request: tuple[str, dict[str, Any], str, int]
) -> None:
    path, body, param, status = request
    data = json.dumps(body).encode()  # NaN and Infinity as Python writes them
    verdict = check(served, "one invalid field", served.post(path, data, JSON_HEADERS))
    assert verdict.status == status, (verdict, body)
    assert verdict.error is not None
    named = verdict.error["param"]
    assert named is not None
    assert named == param or named.startswith((f"{param}.", f"{param}[")), (verdict, body)


def test_the_fuzzers_reach_their_request_path(served: Served) -> None:
    """Behind the data plane a plain valid body is served by the data plane itself, not handed
    to the Python gateway: else the fuzzers there would judge only the Python gateway again."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    before = served.python_requests
    verdict = served.post(CHAT, json.dumps(body).encode(), JSON_HEADERS)
    assert verdict.outcome is Outcome.ANSWERED, verdict
    assert served.upstream.stages() == ["render", "prefill", "decode", "derender"]
    assert served.python_requests - before == (0 if served.path == "dataplane" else 1)
