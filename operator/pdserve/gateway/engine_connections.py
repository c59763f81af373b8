"""The engines' kept-alive connections, reused only while nothing unexpected came over them.

An HTTP/1.1 server speaks only when asked: bytes that arrive on a connection while it waits in
the pool for its next request (an engine or a proxy in front of it writing past the end of an
answer) are not an answer to anything. aiohttp's client parses them anyway and queues them as
the next request's response, so one client would read another's answer (or a forged one).
Here such a connection is closed the moment those bytes arrive, and never reused.

And an answer whose framing breaks once its body has begun (a malformed chunk size) fails the
connection in aiohttp but not the body being read, which then waits for bytes that never come
until the request's whole timeout (600 s by default), engine closed or not: here the body being
read fails with the connection.

aiohttp has no public hook for it: this module, and only it, leans on aiohttp's private parts
(TCPConnector._factory, the ResponseHandler it builds and its _payload, BaseConnector._release).
tests/unit/gateway/test_engine_connections.py fails loudly if they change."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler

log = logging.getLogger("pdserve.gateway")


class _AnswersOnlyWhenAsked(ResponseHandler):
    """A connection's protocol that refuses bytes no request was sent for."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.asked = False
        """A request was sent (or is being sent) and its answer not yet given back."""

    def set_response_params(self, **params: Any) -> None:
        # aiohttp calls this for each request just before it writes the request.
        self.asked = True
        super().set_response_params(**params)

    def data_received(self, data: bytes) -> None:
        if data and not self.asked:
            transport = self.transport
            peer = transport.get_extra_info("peername") if transport is not None else None
            log.warning(
                "an upstream at %s sent %d bytes while no request was outstanding on the "
                "connection: closed it, nothing it sent is read",
                peer,
                len(data),
            )
            self.force_close()
            if transport is not None:
                transport.close()
            return
        super().data_received(data)

    def set_exception(self, exc: BaseException, *cause: BaseException) -> None:
        super().set_exception(exc, *cause)
        body = self._payload
        if body is not None and not body.is_eof():
            # The C parser raises once; its later end of stream says nothing more.
            body.set_exception(aiohttp.ClientPayloadError(f"the answer broke off: {exc}"))


def _answers_only_when_asked(loop: asyncio.AbstractEventLoop) -> ResponseHandler:
    return _AnswersOnlyWhenAsked(loop)


class EngineConnector(aiohttp.TCPConnector):
    """aiohttp's TCPConnector whose pooled connections are closed on unasked-for bytes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._factory = functools.partial(_answers_only_when_asked, loop=self._loop)

    def _release(self, key: Any, protocol: ResponseHandler, *, should_close: bool = False) -> None:
        # The answer was read (or given up on): from here on the connection is owed nothing.
        if isinstance(protocol, _AnswersOnlyWhenAsked):
            protocol.asked = False
        super()._release(key, protocol, should_close=should_close)
