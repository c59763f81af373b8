"""Fuzzing the gateway's input (hypothesis, deterministic): request bodies drawn from the OpenAI
chat and completions schemas (valid ones with random optional parameters, vLLM's extras and
unknown fields; the same with one field made invalid: a wrong type, an out-of-range or huge
number, NaN, a wrong nesting), arbitrary JSON, random bytes, content types and charsets,
encodings, odd headers, methods and paths, against the whole gateway on the fake upstream.

Every answer is a 200 with a well-formed OpenAI body (or stream), or an OpenAI-shaped JSON
error with a 4xx for the client's mistake: never text/plain, never a 5xx, never an upstream
address; a body refused never reaches the upstream, and an invalid field's 400 names it."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.gateway.openai_schema import ChatRequest, CompletionRequest
from tests.support.gateway_fakes import MODEL, fake_gateway
from tests.support.outcomes import TALLY, Outcome, Verdict, exchange, judge_json
from tests.support.served_gateway import ServedGateway

CAP = 4096  # --max-tokens-cap
HANG = 10.0  # seconds: only a hang detector
LEAKS = ("http://render", "http://prefill", "http://decode")  # the fake upstream's addresses
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
FUZZ = settings(
    derandomize=True,  # the same examples every run
    database=None,  # nothing written into the repository
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# ---- the fake upstream: a well-formed answer for any accepted request ----------------------------


def _choices(n: Any) -> range:
    return range(min(n, 3) if isinstance(n, int) and n > 0 else 1)


def render(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "token_ids": [1, 2, 3, 4],
        "sampling_params": {"max_tokens": 8, "n": body.get("n") or 1},
        "stream": bool(body.get("stream")),
        "stream_options": body.get("stream_options"),
    }


def prefill(body: dict[str, Any]) -> dict[str, Any]:
    kv = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1]}
    return {"choices": [{"index": 0, "token_ids": [9], "finish_reason": "length"}],
            "kv_transfer_params": kv}  # fmt: skip


def decode(body: dict[str, Any]) -> dict[str, Any]:
    n = body["sampling_params"].get("n")
    return {
        "choices": [{"index": i, "token_ids": [9], "finish_reason": "stop"} for i in _choices(n)],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
    }


def derender(body: dict[str, Any]) -> dict[str, Any]:
    chat = body["chat_request"] is not None
    if body["stream"]:
        [choice] = body["generate_chunk"]["choices"]
        part: dict[str, Any] = {"delta": {"content": "x"}} if chat else {"text": "x"}
        return {"chunk": {"choices": [{"index": choice["index"], **part,
                                       "finish_reason": choice["finish_reason"]}]},
                "stream_state": None}  # fmt: skip
    whole: dict[str, Any] = {"message": {"role": "assistant", "content": "ok"}} if chat else {}
    choices = [
        {"index": c["index"], **(whole or {"text": "ok"}), "finish_reason": c["finish_reason"]}
        for c in body["generate_response"]["choices"]
    ]
    return {"object": "chat.completion" if chat else "text_completion", "choices": choices}


def decode_stream(body: dict[str, Any]) -> list[bytes]:
    n = body["sampling_params"].get("n")
    lines = []
    for i in _choices(n):
        for finish in (None, "stop"):
            event = {"choices": [{"index": i, "token_ids": [9], "finish_reason": finish}]}
            lines.append(f"data: {json.dumps(event)}\n".encode())
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    return [*lines, f"data: {json.dumps({'choices': [], 'usage': usage})}\n".encode(),
            b"data: [DONE]\n"]  # fmt: skip


class Served(ServedGateway):
    """The whole gateway (tokens route, P/D) on the fake upstream."""

    def __init__(self) -> None:
        gateway, upstream = fake_gateway(
            "tokens", "Disaggregated", max_tokens_cap=CAP, endpoint_wait_seconds=0
        )
        upstream.script = {
            "render": render, "prefill": prefill, "decode": decode, "derender": derender,
        }  # fmt: skip
        upstream.stream_lines = decode_stream
        super().__init__(gateway, upstream, auto_decompress=False)

    def post(
        self, path: str, data: bytes, headers: dict[str, str], method: str = "POST"
    ) -> Verdict:
        self.upstream.calls.clear()
        url = self.url(path)

        async def send() -> Verdict:
            if method == "POST":
                return await exchange(
                    self.session, url, data, headers, chat=path == CHAT, deadline=HANG, leaks=LEAKS
                )
            async with self.session.request(method, url, data=data, headers=headers) as answer:
                payload = await answer.read()
                return judge_json(
                    answer.status, answer.content_type, payload, chat=True, leaks=LEAKS, sent=data
                )

        return self.run(send())


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    served = Served()
    try:
        yield served
    finally:
        served.close()


def check(served: Served, case_class: str, verdict: Verdict) -> Verdict:
    """What holds for every request, whatever its input: a clear answer, no 5xx, and a body
    refused before any upstream call (an answered one went upstream)."""
    TALLY.add(f"fuzz: {case_class}", verdict)
    assert verdict.acceptable, verdict
    assert verdict.status is not None
    assert verdict.status < 500, verdict
    if verdict.outcome is Outcome.CLEAR_ERROR:
        assert 400 <= verdict.status < 500, verdict
        assert served.upstream.calls == [], verdict  # refused before render or any engine
    else:
        assert served.upstream.stages()[:1] == ["render"], verdict
    return verdict


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


@st.composite
def valid_request(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    chat = draw(st.booleans())
    required: dict[str, st.SearchStrategy[Any]]
    if chat:
        required = {"messages": st.lists(message, min_size=1, max_size=3)}
        fields = CHAT_FIELDS
    else:
        ids = st.integers(0, 50_000)
        prompts: list[st.SearchStrategy[Any]] = [
            text,
            st.lists(text, min_size=1, max_size=2),
            st.lists(ids, min_size=1, max_size=4),
            st.lists(st.lists(ids, min_size=1, max_size=3), min_size=1, max_size=2),
        ]
        required = {"prompt": st.one_of(prompts)}
        fields = COMPLETION_FIELDS
    body = draw(st.fixed_dictionaries(required, optional=fields))
    body = {**draw(extras), **_consistent(body)}
    return (CHAT if chat else COMPLETIONS), body


def encoded(body: Any, ascii_only: bool) -> bytes:
    return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


JSON_HEADERS = {"Content-Type": "application/json"}


@given(request=valid_request(), ascii_only=st.booleans())
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
    path, body = draw(valid_request())
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


# ---- anything at all -----------------------------------------------------------------------------

any_fields = st.dictionaries(st.sampled_from(sorted(KNOWN)) | text, json_value, max_size=4)


@st.composite
def arbitrary_json(draw: st.DrawFn) -> tuple[str, Any]:
    """Any JSON value, or a valid body whose fields (known or not) are overwritten by any."""
    if draw(st.booleans()):
        return draw(st.sampled_from([CHAT, COMPLETIONS])), draw(json_value | any_fields)
    path, body = draw(valid_request())
    return path, {**body, **draw(any_fields)}


@given(request=arbitrary_json())
@settings(FUZZ, max_examples=150)
def test_arbitrary_json_is_answered_or_refused_clearly(
    served: Served, request: tuple[str, Any]
) -> None:
    path, body = request
    check(served, "arbitrary JSON", served.post(path, encoded(body, True), JSON_HEADERS))


CONTENT_TYPES = [
    None,
    "application/json",
    "application/json; charset=utf-8",
    'application/json; charset="UTF-8"',
    "application/json; charset=utf-16",
    "application/json; charset=latin-1",
    "application/json; charset=no-such-charset",
    "application/json; charset=",
    "text/plain",
    "text/html; charset=utf-8",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=xyz",
    "application/octet-stream",
    "",
    "*/*",
]
VALID = {"messages": [{"role": "user", "content": "héllo ☃"}], "max_tokens": 5}


@st.composite
def raw_body(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    """Bytes and the headers that say what they are: often lies."""
    kind = draw(st.sampled_from(["bytes", "charset", "truncated", "literal", "encoded", "bom"]))
    headers: dict[str, str] = {}
    text_body = json.dumps(VALID, ensure_ascii=False)
    if kind == "bytes":
        data = draw(st.binary(max_size=300))
    elif kind == "charset":  # valid JSON in one charset, maybe declared as another
        codec = draw(st.sampled_from(["utf-8", "utf-16", "utf-16-le", "utf-32", "latin-1"]))
        data = text_body.encode(codec, "replace")
        declared = draw(st.sampled_from([codec, "utf-8", "ascii", "utf-16"]))
        headers["Content-Type"] = f"application/json; charset={declared}"
    elif kind == "truncated":
        data = text_body.encode()[: draw(st.integers(0, len(text_body.encode()) - 1))]
    elif kind == "literal":  # numbers and values Python's parser reads but no engine can use
        value = draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "9" * 5000,
                                      '"\\ud800"', "null", "true", "[]", '"x"', "0"]))  # fmt: skip
        field = draw(st.sampled_from(["max_tokens", "temperature", "n", "seed", "top_p", "x"]))
        data = f'{{"messages": [{{"role": "user", "content": "x"}}], "{field}": {value}}}'.encode()
    elif kind == "encoded":  # compressed, or claiming to be
        plain = text_body.encode()
        encoding = draw(st.sampled_from(["gzip", "deflate", "identity"]))
        squeezed = {"gzip": gzip.compress(plain), "deflate": zlib.compress(plain)}.get(
            encoding, plain
        )
        # (A compressed body cut short is refused by aiohttp's HTTP parser, in text/plain:
        # test_framing_aiohttp_refuses_is_answered_in_the_openai_shape.)
        data = draw(
            st.sampled_from([squeezed, plain] if encoding == "identity" else [squeezed, plain[:20]])
        )
        headers["Content-Encoding"] = encoding
    else:  # a byte order mark, then JSON
        data = b"\xef\xbb\xbf" + text_body.encode()
    if "Content-Type" not in headers:
        content_type = draw(st.sampled_from(CONTENT_TYPES))
        if content_type is not None:
            headers["Content-Type"] = content_type
    return data, headers


header_value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=200)
odd_headers = st.dictionaries(
    st.sampled_from(
        [
            "X-PDServe-Class",
            "X-Conversation-Id",
            "Accept",
            "Accept-Encoding",
            "Accept-Charset",
            "User-Agent",
            "X-Forwarded-For",
            "Cookie",
            "Origin",
            "Expect",
            "X-Anything",
            "Range",
        ]
    ),
    # (No `Expect: 100-continue`: aiohttp's client then waits for a 100 forever when the
    # server refuses the body at once; the gateway answers.)
    header_value | st.sampled_from(["document", "chat", "text/html", "*/*"]),
    max_size=4,
)


@given(path=st.sampled_from([CHAT, COMPLETIONS]), raw=raw_body(), headers=odd_headers)
@settings(FUZZ, max_examples=250)
def test_bytes_content_types_and_headers_get_clear_answers(
    served: Served, path: str, raw: tuple[bytes, dict[str, str]], headers: dict[str, str]
) -> None:
    data, own = raw
    check(served, "bytes, content types, headers", served.post(path, data, {**headers, **own}))


@given(
    method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST"]),
    path=st.sampled_from([CHAT, COMPLETIONS, "/v1/chat", "/v1/completions/x", "/v2/completions"])
    | st.text("abcdefghijklmnopqrstuvwxyz0123456789-_/", max_size=20).map(lambda p: f"/v1/{p}"),
)
@settings(FUZZ, max_examples=60)
def test_other_methods_and_paths_get_openai_errors(served: Served, method: str, path: str) -> None:
    if method == "POST" and path in (CHAT, COMPLETIONS):
        path = f"{path}/"  # that would be a completion
    if path == "/v1/models" and method == "GET":
        return  # the model list
    verdict = check(
        served, "methods and paths", served.post(path, encoded(VALID, True), JSON_HEADERS, method)
    )
    assert verdict.outcome is Outcome.CLEAR_ERROR, verdict
    assert verdict.status in (404, 405), verdict
