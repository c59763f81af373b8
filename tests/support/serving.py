"""Simulated vLLM servers (or any aiohttp app) on real loopback ports."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from aiohttp import web


def listening_socket(port: int = 0) -> socket.socket:
    """A loopback socket already listening (port 0: the kernel picks one), so its address can
    be handed on before the server runs, and no other process can take the port meanwhile."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


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
