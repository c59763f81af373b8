"""Fuzzing what is not a request body at all (hypothesis, deterministic): arbitrary JSON,
random bytes, content types and charsets, encodings, odd headers, methods and paths, against
the whole gateway on a loopback fake upstream, on both request paths: a clear OpenAI-shaped
answer every time, never a 5xx."""

from __future__ import annotations

import gzip
import json
import zlib
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.fuzz_bodies import JSON_HEADERS, KNOWN, encoded, json_value, request_body, text
from tests.support.fuzz_gateway import CHAT, COMPLETIONS, FUZZ, Served, check
from tests.support.outcomes import Outcome

# ---- anything at all -----------------------------------------------------------------------------

any_fields = st.dictionaries(st.sampled_from(sorted(KNOWN)) | text, json_value, max_size=4)


@st.composite
def arbitrary_json(draw: st.DrawFn) -> tuple[str, Any]:
    """Any JSON value, or a valid body whose fields (known or not) are overwritten by any."""
    if draw(st.booleans()):
        return draw(st.sampled_from([CHAT, COMPLETIONS])), draw(json_value | any_fields)
    path, body = draw(request_body())
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
        encoding = draw(st.sampled_from(["gzip", "deflate", "identity", "br"]))
        squeezed = {"gzip": gzip.compress(plain), "deflate": zlib.compress(plain)}.get(
            encoding, plain
        )
        cut_short = squeezed[: draw(st.integers(1, len(squeezed) - 1))]
        data = draw(
            st.sampled_from(
                [squeezed, plain]
                if encoding in ("identity", "br")  # br: refused (415), whatever the bytes
                else [squeezed, plain[:20], cut_short]
            )
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
