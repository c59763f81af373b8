"""The gateway's server (server.py): what aiohttp's HTTP parser refuses is answered in the
OpenAI shape on GatewayRunner, which keeps every option aiohttp's runner would have used; and
the private parts of aiohttp server.py leans on are still there, as it uses them. When aiohttp
changes those, the first test here fails, naming what moved: server.py needs adapting then."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from pdserve.gateway.server import GatewayRunner

HEAD = b"POST /x HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"


async def test_aiohttp_still_has_the_private_parts_server_py_leans_on() -> None:
    assert inspect.iscoroutinefunction(vars(web.AppRunner).get("_make_server")), (
        "aiohttp's AppRunner no longer builds its Server in _make_server"
    )
    parameters = list(inspect.signature(web.RequestHandler.handle_error).parameters)
    assert parameters == ["self", "request", "status", "exc", "message"], (
        f"aiohttp's RequestHandler.handle_error takes {parameters} now"
    )

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        return web.Response()

    loop = asyncio.get_running_loop()
    server = web.Server(handler, loop=loop, max_field_size=123)
    assert getattr(server, "_loop", None) is loop, "aiohttp's Server keeps its loop elsewhere"
    assert getattr(server, "_kwargs", None) == {"max_field_size": 123}, (
        "aiohttp's Server keeps its RequestHandler options elsewhere"
    )
    # What server.py's Server.__call__ copies: a RequestHandler made of those two.
    protocol = server()
    assert type(protocol) is web.RequestHandler
    assert protocol.max_field_size == 123
    parameters = list(inspect.signature(web.RequestHandler.finish_response).parameters)
    assert parameters == ["self", "request", "resp", "start_time"], (
        f"aiohttp's RequestHandler.finish_response takes {parameters} now"
    )
    # What _Connection.skip_lingering sets: how long a closing connection reads an unread body.
    assert getattr(protocol, "_lingering_time", None) == 10.0, (
        "aiohttp's RequestHandler keeps its lingering time elsewhere"
    )


async def failing(request: web.Request) -> web.StreamResponse:
    raise KeyError("secret internal detail")


async def ok(request: web.Request) -> web.StreamResponse:
    return web.json_response(await request.json())


@pytest.fixture
async def served() -> AsyncIterator[tuple[GatewayRunner, int]]:
    app = web.Application(handler_args={"max_field_size": 100})
    app.router.add_post("/x", ok)
    app.router.add_post("/fails", failing)
    runner = GatewayRunner(app, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield runner, runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def exchange(port: int, request: bytes) -> tuple[int, str, dict[str, Any]]:
    """Send `request` as is; the status, content type and JSON body of the answer, read to the
    connection's end (each refusal closes it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers["Content-Type"].split(";")[0], json.loads(body)


def openai_error(status: int, content_type: str, body: dict[str, Any]) -> dict[str, Any]:
    assert content_type == "application/json"
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert "Traceback" not in error["message"]
    return error  # type: ignore[no-any-return]


async def test_the_runner_keeps_aiohttps_options(served: tuple[GatewayRunner, int]) -> None:
    runner, port = served
    assert runner.server is not None
    assert runner.server.handler_cancellation is True
    # The app's handler_args reach the connections: the header limit set above is the one
    # refused, by name.
    status, content_type, body = await exchange(
        port, HEAD + b"X-Big: " + b"x" * 200 + b"\r\nContent-Length: 2\r\n\r\n{}"
    )
    error = openai_error(status, content_type, body)
    assert status == 431
    assert error["type"] == "RequestHeaderFieldsTooLarge"
    assert error["message"] == (
        "a request header (or the request line) is longer than 100 bytes, the most the gateway "
        "reads; send shorter headers"
    )


async def test_a_request_well_framed_is_served_as_by_aiohttp(
    served: tuple[GatewayRunner, int],
) -> None:
    _, port = served
    status, content_type, body = await exchange(
        port, HEAD + b'Content-Length: 8\r\nConnection: close\r\n\r\n{"a": 1}'
    )
    assert (status, content_type, body) == (200, "application/json", {"a": 1})


@pytest.mark.parametrize(
    ("request_bytes", "message"),
    [
        (
            HEAD + b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n{}",
            "the request has both Content-Length and Transfer-Encoding headers; send one: "
            "Content-Length for a body of known size, or Transfer-Encoding: chunked",
        ),
        (
            HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
            "the request is not valid HTTP/1.1: ",
        ),
        (
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",
            "the request is not valid HTTP/1.1: ",
        ),
    ],
    ids=["length-and-chunked", "broken-chunk", "tls-on-the-http-port"],
)
async def test_what_the_parser_refuses_is_a_400_in_the_openai_shape(
    served: tuple[GatewayRunner, int], request_bytes: bytes, message: str
) -> None:
    _, port = served
    status, content_type, body = await exchange(port, request_bytes)
    error = openai_error(status, content_type, body)
    assert status == 400
    assert error["type"] == "BadRequestError"
    assert error["message"].startswith(message)


async def test_a_handler_failing_past_every_middleware_is_a_500_that_gives_nothing_away(
    served: tuple[GatewayRunner, int], caplog: pytest.LogCaptureFixture
) -> None:
    _, port = served
    with caplog.at_level(logging.ERROR, logger="pdserve.gateway"):
        status, content_type, body = await exchange(
            port, b"POST /fails HTTP/1.1\r\nHost: gw\r\n\r\n"
        )
    error = openai_error(status, content_type, body)
    assert status == 500
    assert error["message"] == "the gateway failed to serve the request"
    assert "secret internal detail" in caplog.text  # in the log, with its stack
