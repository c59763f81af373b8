"""Simulated vLLM servers (or any aiohttp app) on real loopback ports."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from aiohttp import web

from pdserve.ports import listening_socket as listening_socket  # re-exported: the tests' import


@asynccontextmanager
async def serving(
    app: web.Application,
    port: int | None = None,
    *,
    runner_class: type[web.AppRunner] = web.AppRunner,
    sock: socket.socket | None = None,
) -> AsyncIterator[str]:
    """Run an aiohttp app on a loopback port (one the kernel picks by default, or `sock`, a
    listening_socket whose address was handed on already); yields its base URL. A gateway's app
    runs on `runner_class=GatewayRunner`, as `pdserve gateway` runs it."""
    runner = runner_class(app, handler_cancellation=True)
    await runner.setup()
    sock = sock if sock is not None else listening_socket(port or 0)
    site = web.SockSite(runner, sock)
    await site.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


AppFactory = Callable[[], web.Application]
