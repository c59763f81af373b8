"""Simulated vLLM servers (or any aiohttp app) on real loopback ports."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from aiohttp import web

from pdserve.ports import listening_socket as listening_socket  # re-exported: the tests' import
from pdserve.sim.engine_config import EngineConfig
from pdserve.sim.engine_server import EngineServer


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


@asynccontextmanager
async def serving_engine(config: EngineConfig) -> AsyncIterator[tuple[EngineServer, str]]:
    """An engine simulator on a loopback port that listens before the engine is built: it
    names its own port in the KV parameters it hands out (remote_port), so its config gets the
    listening socket's port (config.port is ignored). Yields the server and its base URL."""
    sock = listening_socket()
    server = EngineServer(dataclasses.replace(config, port=sock.getsockname()[1]))
    async with serving(server.app(), sock=sock) as url:
        yield server, url
