"""Simulated vLLM servers (or any aiohttp app) on real loopback ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from aiohttp import web

from devtools.localplane import free_port


@asynccontextmanager
async def serving(
    app: web.Application,
    port: int | None = None,
    *,
    runner_class: type[web.AppRunner] = web.AppRunner,
) -> AsyncIterator[str]:
    """Run an aiohttp app on a loopback port (a free one by default); yields its base URL.
    A gateway's app runs on `runner_class=GatewayRunner`, as `pdserve gateway` runs it."""
    runner = runner_class(app, handler_cancellation=True)
    await runner.setup()
    port = port or free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


AppFactory = Callable[[], web.Application]
