"""A gateway on the loopback fake upstream, served from an event loop of its own, on either
request path: the Python gateway alone, or behind the compiled data plane (`--data-plane`),
which then takes the clients' port. Hypothesis runs a test's examples synchronously, so one
server (and one client session) serves them all."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from pdserve.gateway.app import Gateway
from pdserve.gateway.dataplane import build_binary
from pdserve.gateway.server import GatewayRunner
from pdserve.ports import listening_socket
from tests.support.loopback_upstream import LoopbackUpstream

T = TypeVar("T")
REQUEST_PATHS = ("python", "dataplane")
"""The gateway's request paths: the Python gateway alone, and behind the compiled data plane
(`pdserve gateway --data-plane`). A client must not see which one served it."""


class ServedGateway:
    """`make_gateway`: the gateway over the upstream's pools (their URLs); `request_path`: one
    of REQUEST_PATHS; `session`: the client session's options."""

    def __init__(
        self,
        make_gateway: Callable[[Mapping[str, str]], Gateway],
        upstream: LoopbackUpstream,
        request_path: str,
        **session: Any,
    ) -> None:
        assert request_path in REQUEST_PATHS, request_path
        self.path = request_path
        self.loop = asyncio.new_event_loop()
        self.upstream = upstream
        self.runner: GatewayRunner | None = None
        self.python_requests = 0
        """Requests the Python gateway received: behind the data plane, those handed to it."""
        self.session = self.run(self._start(make_gateway, session))

    async def _start(
        self, make_gateway: Callable[[Mapping[str, str]], Gateway], options: dict[str, Any]
    ) -> aiohttp.ClientSession:
        await self.upstream.start()
        self.gateway = make_gateway(self.upstream.urls)
        # Listening before the data plane is told where the Python gateway is.
        sock = listening_socket()
        if self.path == "dataplane":
            python_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            self.gateway.use_data_plane(build_binary(), "127.0.0.1:0", python_url)
        app = self.gateway.app()
        app.middlewares.insert(0, self._count)
        self.runner = GatewayRunner(app, handler_cancellation=True)
        await self.runner.setup()  # starts the data plane, when there is one
        await web.SockSite(self.runner, sock).start()
        if self.gateway.data_plane is not None:
            assert self.gateway.data_plane.address is not None
            self.base_url = f"http://{self.gateway.data_plane.address}"
        else:
            host, bound = self.runner.addresses[0][:2]
            self.base_url = f"http://{host}:{bound}"
        return aiohttp.ClientSession(**options)

    @web.middleware
    async def _count(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        self.python_requests += 1
        return await handler(request)

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(work)

    def url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    def close(self) -> None:
        self.run(self.session.close())
        if self.runner is not None:
            self.run(self.runner.cleanup())
        self.run(self.upstream.stop())
        self.loop.close()
