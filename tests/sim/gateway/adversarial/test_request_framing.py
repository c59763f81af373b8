"""Requests framed to smuggle or to confuse, sent as raw bytes to both request paths: each gets
the same status, in the OpenAI error shape (type, code, param), and a connection whose framing
cannot be trusted is closed after the answer, so nothing after a refused request is ever served
as a request of its own (RFC 9112 6.1, 6.3: Content-Length with Transfer-Encoding is refused)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest

from tests.sim.gateway.adversarial.conftest import behind_data_plane
from tests.support.outcomes import TALLY, Outcome, Verdict, judge_json
from tests.support.sim_gateway import Stack, pd_stack

HANG = 10.0
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
COMPLETION = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
MODELS_HEAD = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"


@dataclass(frozen=True)
class Shape:
    request: bytes
    status: int
    closed: bool
    """The gateway closes the connection after its answer (its framing cannot be trusted)."""
    says: str = ""
    """In the error's message, on both paths."""
    kind: str = "BadRequestError"


INVALID = "the request is not valid HTTP/1.1"
SHAPES = {
    # Smuggling: a body length two ways, or one that is not a plain number.
    "length and chunked": Shape(
        COMPLETION + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + MODELS,
        400, True, "both Content-Length and Transfer-Encoding"),
    "chunked and length": Shape(
        COMPLETION + b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n" + MODELS,
        400, True, "both Content-Length and Transfer-Encoding"),
    "two equal lengths": Shape(
        COMPLETION + b"Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}" + MODELS,
        400, True, "Duplicate Content-Length"),
    "two lengths": Shape(
        COMPLETION + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400, True,
        "Duplicate Content-Length"),
    "length list": Shape(
        COMPLETION + b"Content-Length: 2, 2\r\n\r\n{}", 400, True, "Content-Length"),
    "signed length": Shape(
        COMPLETION + b"Content-Length: +2\r\n\r\n{}", 400, True, "Content-Length"),
    "negative length": Shape(
        COMPLETION + b"Content-Length: -1\r\n\r\n", 400, True, "Content-Length"),
    "gzip coding": Shape(
        COMPLETION + b"Transfer-Encoding: gzip\r\n\r\n", 400, True, "Transfer-Encoding"),
    "gzip then chunked": Shape(
        COMPLETION + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n" + MODELS,
        400, True, "Transfer-Encoding"),
    "chunked twice": Shape(
        COMPLETION + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n", 400, True, "Transfer-Encoding"),
    "chunked in HTTP/1.0": Shape(
        b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n", 400, True, "Transfer-Encoding in an HTTP/1.0 request"),
    "chunk size not a number": Shape(
        COMPLETION + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400, True,
        "chunk size"),
    "chunk size line ends in LF": Shape(
        COMPLETION + b"Transfer-Encoding: chunked\r\n\r\n2\n{}\r\n0\r\n\r\n", 400, True,
        "chunk size"),
    # Heads aiohttp's parser refuses: the data plane must too.
    "folded header": Shape(MODELS_HEAD + b"X-A: a\r\n b\r\n\r\n", 400, True, INVALID),
    "bare LF line endings": Shape(b"GET /v1/models HTTP/1.1\nHost: x\n\n", 400, True, INVALID),
    "a header ends in LF": Shape(
        b"GET /v1/models HTTP/1.1\r\nHost: x\nX-A: b\r\n\r\n", 400, True,
        "Missing expected CR after header value"),
    "control character in a value": Shape(
        MODELS_HEAD + b"X-A: a\x01b\r\n\r\n", 400, True, "Invalid header value char"),
    "space in a name": Shape(MODELS_HEAD + b"X A: b\r\n\r\n", 400, True, "Invalid header token"),
    "space before the colon": Shape(
        MODELS_HEAD + b"X-A : b\r\n\r\n", 400, True, "Invalid header token"),
    "no colon": Shape(MODELS_HEAD + b"XA\r\n\r\n", 400, True, "Invalid header token"),
    "no Host": Shape(b"GET /v1/models HTTP/1.1\r\n\r\n", 400, True, "Host"),
    "bad method": Shape(b"G@T /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 400, True, INVALID),
    "HTTP/2.0 request line": Shape(
        b"GET /v1/models HTTP/2.0\r\nHost: x\r\n\r\n", 400, True, "HTTP version"),
    "70 KB header line": Shape(
        MODELS_HEAD + b"X-A: " + b"a" * 70_000 + b"\r\n\r\n", 431, True, "8190 bytes",
        "RequestHeaderFieldsTooLarge"),
    "9 KB request target": Shape(
        b"GET /v1/models?" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431, True,
        "8190 bytes", "RequestHeaderFieldsTooLarge"),
    # Expectations: only 100-continue is understood.
    "unknown Expect": Shape(
        COMPLETION + b"Expect: fish\r\nContent-Length: 2\r\n\r\n{}", 417, True, "unknown Expect",
        "ExpectationFailed"),
    "unknown Expect, no route": Shape(
        b"GET /nope HTTP/1.1\r\nHost: x\r\nExpect: fish\r\n\r\n", 417, True, "unknown Expect",
        "ExpectationFailed"),
    "unknown Expect, HTTP/1.0": Shape(
        b"GET /v1/models HTTP/1.0\r\nHost: x\r\nExpect: fish\r\n\r\n", 417, True,
        "unknown Expect", "ExpectationFailed"),
    # Paths are taken as sent: no redirect to a cleaned one, POST or not.
    "dot-dot path": Shape(
        b"POST /v1/chat/completions/../completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2"
        b"\r\n\r\n{}", 404, False, "Not Found", "NotFoundError"),
    "double slash": Shape(
        b"POST //v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 404, False,
        "Not Found", "NotFoundError"),
    "dot segment": Shape(
        b"GET /v1/./models HTTP/1.1\r\nHost: x\r\n\r\n", 404, False, "Not Found",
        "NotFoundError"),
    "asterisk target": Shape(
        b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 404, False, "Not Found", "NotFoundError"),
    "wrong method": Shape(
        b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 405, False, "Method Not Allowed",
        "APIError"),
    # What is well framed is served, and the connection kept.
    "8190-byte header line": Shape(
        MODELS_HEAD + b"X-A: " + b"a" * 8185 + b"\r\n\r\n", 200, False),
    "40 headers of 4 KB": Shape(
        MODELS_HEAD + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 4000) for i in range(40)) + b"\r\n",
        200, False),
    "CRLF before the request line": Shape(b"\r\n" + MODELS, 200, False),
    "percent-encoded path": Shape(b"GET /v1/%6dodels HTTP/1.1\r\nHost: x\r\n\r\n", 200, False),
    "absolute target": Shape(b"GET http://x/v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 200, False),
    "chunk extension and a trailer": Shape(
        COMPLETION + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2;a=b\r\n{}\r\n0\r\nX-T: y\r\n\r\n", 400, False, "prompt is required"),
    "Chunked in capitals": Shape(
        COMPLETION + b"Transfer-Encoding: Chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 400, False,
        "prompt is required"),
}  # fmt: skip


async def answer(reader: asyncio.StreamReader) -> tuple[int, str, bytes]:
    """One answer off the connection: status, content type, body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG)
    lines = head.decode("latin-1").split("\r\n")
    fields = {
        name.strip().lower(): value.strip()
        for name, _, value in (line.partition(":") for line in lines[1:] if line)
    }
    body = await asyncio.wait_for(reader.readexactly(int(fields["content-length"])), HANG)
    return int(lines[0].split(" ", 2)[1]), fields.get("content-type", ""), body


@pytest.mark.parametrize("name", list(SHAPES))
async def test_a_request_framed_to_confuse_gets_the_same_answer_on_every_path(
    stack: Stack, request_path: str, name: str
) -> None:
    shape = SHAPES[name]
    client = await pd_stack(stack, data_plane=behind_data_plane(request_path))
    reader, writer = await asyncio.open_connection(client.base_url.host, client.base_url.port)
    try:
        writer.write(shape.request)
        await writer.drain()
        status, content_type, body = await answer(reader)
        verdict: Verdict = judge_json(status, content_type.split(";")[0], body, chat=False)
        if status == 200:  # the model list: not a completion, judged as JSON only
            verdict = Verdict(Outcome.ANSWERED, 200)
        TALLY.add(f"request framing ({request_path})", verdict)
        assert verdict.outcome in (Outcome.ANSWERED, Outcome.CLEAR_ERROR), verdict
        assert status == shape.status, body
        if status != 200:
            error = json.loads(body)["error"]
            assert (error["type"], error["code"]) == (shape.kind, status), error
            assert shape.says in error["message"], error
        if shape.closed:
            # Closed after the answer: what followed the refused request is never served.
            assert await asyncio.wait_for(reader.read(), HANG) == b""
        else:  # kept alive: the next request on it is served
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            assert (await answer(reader))[0] == 200
    finally:
        writer.close()
