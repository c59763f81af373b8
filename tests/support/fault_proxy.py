"""A loopback proxy in front of a simulated engine or render server that injects a fault into
the next calls of one path: the stage-level faults the simulators themselves lack (a hang or a
malformed answer on render and derender, a stream that stalls or carries a malformed event...).
It forwards everything else as it came, aborts included, and records what passed. With
`holds_upstream` it stands for a proxy that does not pass a client's disconnect on."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.vllm.protocol import ABORT_PATH

ABORT_PATHS = (ABORT_PATH, "/abort_requests")
"""vLLM's abort endpoints: the scale-out one and the legacy one (--tokens-only only)."""
# What the proxy's own errors say: an address a gateway must not pass on to its client.
INJECTED_MESSAGE = "injected failure at http://10.9.8.7:8000 (host decode-7:8000)"

FAULTS = ("5xx", "hang", "stall", "slow", "drop", "malformed", "wrong_shape", "gone")
"""5xx: a 500 with an error body naming an address. hang: no answer at all. stall: the answer
starts (a stream: a few events; JSON: half the body), then silence. slow: the answer comes
late (its first byte, and every event of a stream), within every bound. drop: the answer is
cut (the connection closed mid-stream or mid-body). malformed: a 200 that is not JSON (a
stream: an event that is not). wrong_shape: a 200 of JSON that is not what the call answers
(a stream: an event whose choices are not a list of objects). gone: the connection closed with
no answer, as when the process dies."""


@dataclass
class Fault:
    kind: str
    path: str
    """The calls it applies to: their path ends with this."""
    times: int = 1
    after_events: int = 2
    """stall, drop, malformed, wrong_shape of a stream: the events relayed first."""


@dataclass
class FaultProxy:
    target: str
    slow_seconds: float = 0.15
    slow_event_seconds: float = 0.005
    faults: list[Fault] = field(default_factory=list)
    calls: list[tuple[str, str | None]] = field(default_factory=list)
    """(path, X-Request-Id) of every POST that passed."""
    aborted: list[str] = field(default_factory=list)
    """Request ids the proxy was told to abort (and passed on), on either abort path."""
    holds_upstream: bool = False
    """Keep a call to the target going when its client leaves (the rest of its answer read
    and dropped): the engine's work then stops only when it is told to abort."""
    injected: int = 0
    _closing: asyncio.Event = field(default_factory=asyncio.Event)
    _session: aiohttp.ClientSession | None = None
    _held: set[asyncio.Task[web.StreamResponse]] = field(default_factory=set)

    def inject(self, kind: str, path: str, **options: Any) -> None:
        assert kind in FAULTS, kind
        self.faults.append(Fault(kind, path, **options))

    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.on_shutdown.append(self._shutdown)
        return app

    async def _shutdown(self, _: web.Application) -> None:
        self._closing.set()  # hung answers end, so the server can stop
        for task in list(self._held):
            task.cancel()
        if self._session is not None:
            await self._session.close()

    def _take(self, path: str) -> Fault | None:
        for fault in self.faults:
            if fault.times > 0 and path.endswith(fault.path):
                fault.times -= 1
                self.injected += 1
                return fault
        return None

    async def forward(self, request: web.Request) -> web.StreamResponse:
        if not self.holds_upstream:
            return await self._forward(request)
        # Shielded: the client's leaving cancels this handler, not the call to the target.
        task = asyncio.ensure_future(self._forward(request))
        self._held.add(task)
        task.add_done_callback(self._done_holding)
        return await asyncio.shield(task)

    def _done_holding(self, task: asyncio.Task[web.StreamResponse]) -> None:
        self._held.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a held call that failed has no one to tell

    async def _write(self, response: web.StreamResponse, data: bytes) -> None:
        try:
            await response.write(data)
        except ConnectionResetError:
            if not self.holds_upstream:
                raise  # the client left: the call to the target ends with it

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        path = request.path
        if request.method == "POST" and path in ABORT_PATHS:
            self.aborted += [str(i) for i in json.loads(body).get("request_ids", [])]
        fault = self._take(path) if request.method == "POST" else None
        if request.method == "POST":
            self.calls.append((path, request.headers.get("X-Request-Id")))
        if fault is not None:
            early = await self._early(request, fault)
            if early is not None:
                return early
        if self._session is None:
            self._session = aiohttp.ClientSession()
        headers = {
            k: v for k, v in request.headers.items() if k in ("Content-Type", "X-Request-Id")
        }
        async with self._session.request(
            request.method, f"{self.target}{request.path_qs}", data=body, headers=headers
        ) as upstream:
            if upstream.content_type == "text/event-stream":
                return await self._stream(request, upstream, fault)
            payload = await upstream.read()
            if fault is not None and upstream.status == 200:
                return await self._json_fault(request, payload, fault)
            return web.Response(
                body=payload, status=upstream.status, content_type=upstream.content_type
            )

    async def _early(self, request: web.Request, fault: Fault) -> web.StreamResponse | None:
        """Faults that answer before (or instead of) the real server."""
        if fault.kind == "5xx":
            error = {"message": INJECTED_MESSAGE, "type": "InternalServerError", "code": 500}
            return web.json_response({"error": error}, status=500)
        if fault.kind == "hang":
            await self._closing.wait()
            return web.json_response({}, status=503)
        if fault.kind == "gone":
            assert request.transport is not None
            request.transport.close()
            return web.Response()  # never sent: the connection is closed
        if fault.kind == "slow":
            await asyncio.sleep(self.slow_seconds)
        return None

    async def _json_fault(
        self, request: web.Request, payload: bytes, fault: Fault
    ) -> web.StreamResponse:
        if fault.kind == "malformed":
            return web.Response(text="<html>502 Bad Gateway</html>", content_type="text/html")
        if fault.kind == "wrong_shape":
            return web.json_response({"object": "surprise", "data": [1, 2, 3]})
        if fault.kind in ("stall", "drop"):
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            response.content_length = len(payload)
            await response.prepare(request)
            await response.write(payload[: len(payload) // 2])
            if fault.kind == "stall":
                await self._closing.wait()
            assert request.transport is not None
            request.transport.close()
            return response
        return web.Response(body=payload, content_type="application/json")  # slow

    async def _stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse, fault: Fault | None
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            status=upstream.status,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
        )
        await response.prepare(request)
        events = 0
        async for line in upstream.content:
            if fault is not None and events == fault.after_events and line.startswith(b"data:"):
                if fault.kind == "stall":
                    await self._closing.wait()
                    return response
                if fault.kind == "drop":
                    assert request.transport is not None
                    request.transport.close()
                    return response
                if fault.kind == "malformed":
                    await self._write(response, b'data: {"choices": [{"index": 0, "tok\n\n')
                if fault.kind == "wrong_shape":
                    await self._write(response, b'data: {"choices": "surprise"}\n\n')
            if line.startswith(b"data:"):
                events += 1
                if fault is not None and fault.kind == "slow":
                    await asyncio.sleep(self.slow_event_seconds)
            await self._write(response, line)
        return response
