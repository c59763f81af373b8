"""The HTTP server the gateway runs on: aiohttp's, except that what aiohttp's HTTP parser
refuses before any route or middleware sees the request (a header over 8 KiB, Content-Length
with Transfer-Encoding, a broken chunked body...) is answered in the OpenAI error shape, as
everything else is, not in aiohttp's own text/plain.

aiohttp has no public hook for those answers (aio-libs/aiohttp#3287): its RequestHandler writes
them in handle_error, so the gateway's connections are a RequestHandler subclass. aiohttp builds
its RequestHandler in web.Server.__call__, and AppRunner builds that Server in _make_server, so
this module, and only it, leans on aiohttp's private parts: AppRunner._make_server,
Server._loop, Server._kwargs, RequestHandler._lingering_time and RequestHandler.finish_response.
tests/unit/gateway/test_server.py fails loudly if they change.
Everything that serves the gateway (`pdserve gateway`, the bench's simulated gateway, the
tests) does it on GatewayRunner."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Protocol

from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError

from pdserve.gateway.errors import (
    GatewayError,
    client_error,
    error_response,
    framing_error,
    http_error_response,
)

log = logging.getLogger("pdserve.gateway")


class _Connection(web.RequestHandler):
    """One client connection: aiohttp's, with its own answers in the OpenAI shape."""

    __slots__ = ()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to a request its parser refused (400, `exc` the parser's error), or
        whose handler raised past every middleware (500; 504 for a timeout)."""
        if request.writer.output_size > 0:
            # As aiohttp's own: once a response is under way, an error cannot replace it.
            raise ConnectionError("a response is already being sent: no room for an error")
        if isinstance(exc, HttpProcessingError):
            answer = framing_error(exc, self.max_field_size)
            # The client's mistake: the gateway does not log those (Gateway._log_failure).
            log.debug("refused a request from %s: %s", request.remote, exc)
        else:
            if isinstance(exc, Exception):
                answer = client_error(exc)
            else:
                answer = GatewayError(status, HTTPStatus(status).phrase)
            log.error("unexpected failure outside the gateway's handlers", exc_info=exc)
        response = error_response(answer)
        # What follows a refused request on its connection cannot be told apart from its body.
        response.force_close()
        return response

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if isinstance(resp, web.HTTPException) and resp.status >= 400:
            # aiohttp's own refusal past every middleware: a request for no route with an
            # Expect other than 100-continue (its default expect handler raises).
            resp = refusal(request, resp)
        return await super().finish_response(request, resp, start_time)

    def skip_lingering(self) -> None:
        """The request's body will not come (its Expect was refused before any 100 Continue):
        close after the answer, not after aiohttp's wait (10 s) for the body to be sent."""
        self._lingering_time = 0.0


def refusal(request: web.BaseRequest, error: web.HTTPException) -> web.Response:
    """aiohttp's HTTPException as the gateway answers it: an Expect it does not understand in
    the gateway's words, anything else as errors.http_error_response, the connection closed
    when no body was read."""
    if isinstance(error, web.HTTPExpectationFailed):
        expect = request.headers.get("Expect", "")
        message = f"unknown Expect: {expect}; only 100-continue is understood"
        answer = error_response(GatewayError(417, message, kind="ExpectationFailed"))
        answer.force_close()
        return answer
    return http_error_response(error)


def body_will_not_come(request: web.BaseRequest) -> None:
    """See _Connection.skip_lingering; nothing on a connection served another way (a test's)."""
    if isinstance(request.protocol, _Connection):
        request.protocol.skip_lingering()


class _Server(web.Server):
    def __call__(self) -> web.RequestHandler:
        # aiohttp's own Server.__call__, with _Connection for its RequestHandler.
        return _Connection(self, loop=self._loop, **self._kwargs)


CLIENT_KEEPALIVE = web.AppKey("client_keepalive_seconds", float)
"""The app's keep-alive bound on its clients' connections (GatewaySettings.keepalive_timeout)."""


class GatewayRunner(web.AppRunner):
    """web.AppRunner whose connections answer aiohttp's refusals in the OpenAI shape, and are
    closed once idle (or their next request's head incomplete) for the app's CLIENT_KEEPALIVE:
    aiohttp's own default keeps them an hour."""

    __slots__ = ()

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        if CLIENT_KEEPALIVE in app:
            kwargs.setdefault("keepalive_timeout", app[CLIENT_KEEPALIVE])
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()
        return _Server(
            made.request_handler,
            request_factory=made.request_factory,
            handler_cancellation=made.handler_cancellation,
            loop=made._loop,
            **made._kwargs,
        )


async def serve(
    app: web.Application,
    host: str,
    port: int,
    *,
    shutdown_timeout: float,
    drain_seconds: float = 0,
    front: Front | None = None,
    sock: socket.socket | None = None,
) -> None:
    """web.run_app's job on GatewayRunner: serve `app` until a signal, then stop accepting and
    give the requests in flight `shutdown_timeout` seconds to finish.

    SIGTERM first drains for `drain_seconds`: the gateway keeps accepting (kube-proxy and load
    balancers take a while to stop sending new connections to a pod being deleted) and every
    answer says `Connection: close` and closes its connection. A client on a kept-alive
    connection so reconnects, to another replica, between two requests. Closing a connection a
    busy client is about to reuse would instead fail its next request ("server disconnected"),
    which no client can tell apart from a crash. SIGINT (or a second signal) skips or ends the
    drain.

    `front`: a process in front that holds the clients' port (the data plane): it drains with
    this server and stops before it, while this server still serves what it hands over.
    `sock`: a socket already listening (then `host` and `port` only name it), whose address the
    front was given before this server ran."""
    draining = False

    async def close_after_answer(request: web.BaseRequest, response: web.StreamResponse) -> None:
        if draining:
            # The header too: aiohttp computed it before this hook runs.
            response.force_close()
            response.headers[hdrs.CONNECTION] = "close"

    app.on_response_prepare.append(close_after_answer)
    signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, signals.put_nowait, signum)
    # A client that disconnects cancels its handler, which aborts the engines' work.
    # No access log: the request log (--request-log) records every request, off the hot path.
    runner = GatewayRunner(
        app, handler_cancellation=True, shutdown_timeout=shutdown_timeout, access_log=None
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port) if sock is None else web.SockSite(runner, sock)
        await site.start()
        if await signals.get() is signal.SIGTERM and drain_seconds > 0:
            draining = True
            if front is not None:
                await front.drain()
            log.info(
                "SIGTERM: draining for %g s (each answer closes its connection), then stopping",
                drain_seconds,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(signals.get(), drain_seconds)
    finally:
        if front is not None:
            await front.stop()
        await runner.cleanup()


class Front(Protocol):
    async def drain(self) -> None: ...
    async def stop(self) -> None: ...


def run(
    app: web.Application,
    host: str,
    port: int,
    *,
    shutdown_timeout: float = 60,
    drain_seconds: float = 0,
    front: Front | None = None,
    sock: socket.socket | None = None,
) -> None:
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(
            serve(
                app,
                host,
                port,
                shutdown_timeout=shutdown_timeout,
                drain_seconds=drain_seconds,
                front=front,
                sock=sock,
            )
        )


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (a dependency on Linux and macOS): the loop
    and its sockets are a sixth of the gateway's CPU per request on asyncio's own."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
