"""A gateway on the fake upstream, served on loopback from an event loop of its own: hypothesis
runs a test's examples synchronously, so one server (and one client session) serves them all."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from pdserve.gateway.app import Gateway
from pdserve.gateway.server import GatewayRunner
from tests.support.gateway_fakes import FakeUpstream

T = TypeVar("T")


class ServedGateway:
    def __init__(self, gateway: Gateway, upstream: FakeUpstream, **session: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.gateway, self.upstream = gateway, upstream
        self.runner = GatewayRunner(gateway.app(), handler_cancellation=True)
        self.session = self.run(self._start(session))

    async def _start(self, options: dict[str, Any]) -> aiohttp.ClientSession:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        host, port = self.runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}"
        return aiohttp.ClientSession(**options)

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(work)

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def close(self) -> None:
        self.run(self.session.close())
        self.run(self.runner.cleanup())
        self.loop.close()
