"""The HTTP pieces the simulated servers share: vLLM's error bodies, reading a JSON request,
health and Prometheus answers, server-sent events, and starting a server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from pdserve import __version__


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }
    return web.json_response(body, status=status)


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HttpError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HttpError(400, "request body must be a JSON object")
    return body


async def health(_: web.Request) -> web.Response:
    return web.Response(status=200)


async def version(_: web.Request) -> web.Response:
    """As vLLM's /version: what the engine runs (the gateway's replica check compares it)."""
    return web.json_response({"version": f"pdserve-sim {__version__}"})


def metrics_response(registry: CollectorRegistry) -> web.Response:
    """A registry in Prometheus' text format, as GET /metrics answers it."""
    return web.Response(body=generate_latest(registry), content_type="text/plain", charset="utf-8")


# ---- server-sent events --------------------------------------------------------------------------
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(data: Any) -> bytes:
    """One `data: JSON` event."""
    return f"data: {json.dumps(data)}\n\n".encode()


async def open_sse(request: web.Request, headers: Mapping[str, str]) -> web.StreamResponse:
    """A prepared event-stream response with these headers (Content-Type among them)."""
    response = web.StreamResponse(headers=dict(headers))
    await response.prepare(request)
    return response


# ---- starting a server ---------------------------------------------------------------------------
def run(app: web.Application, host: str, port: int) -> None:
    """Serve until interrupted (a simulator process's main loop). A client that disconnects
    cancels its handler, which aborts its work, as vLLM's API server does for every request
    (streamed or not)."""
    web.run_app(app, host=host, port=port, print=None, handler_cancellation=True)


@asynccontextmanager
async def serving(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[int]:
    """Serve app in this event loop (port 0: a free one) until the block ends; yields the port.
    Handlers are cancelled when their client disconnects, as in `run`."""
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
