"""A fake upstream on loopback ports: the render server and the prefill and decode engines as
real HTTP servers (aiohttp), each call answered from a script as gateway_fakes.FakeUpstream
answers it, and recorded the same way. The compiled data plane cannot reach a mocked client:
on this upstream both request paths, the Python gateway alone and behind the data plane, are
judged against the same engines."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from functools import partial
from typing import Any

from aiohttp import web

from pdserve.vllm.protocol import ABORT_PATH, GENERATE_PATH, derender_path, render_path
from tests.support.gateway_fakes import Call

Script = Callable[[dict[str, Any]], Any]
POOLS = ("render", "prefill", "decode")
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions")
STAGES: dict[tuple[str, str], str] = {
    **{("render", render_path(chat)): "render" for chat in (True, False)},
    **{("render", derender_path(chat)): "derender" for chat in (True, False)},
    **{(pool, path): pool for pool in ("prefill", "decode")
       for path in (GENERATE_PATH, *OPENAI_PATHS)},
}  # fmt: skip
"""(pool, path) -> the stage a call is: what the gateway and the data plane call, and where."""


class LoopbackUpstream:
    """One server per pool on 127.0.0.1 (`urls`, once started). `script`: per stage, what it
    answers for the call's body (a JSON value); a decode call that asks for a stream
    (`"stream": true`) is the stage `decode_stream`, answered with the events `stream_lines`
    gives for its body. `calls`: every call but aborts (`aborted`), in the order they came; a
    call to a path no stage serves is recorded as the stage `unexpected` and answered 404."""

    def __init__(self, script: dict[str, Script], stream_lines: Script | None = None) -> None:
        self.script, self.stream_lines = script, stream_lines
        self.calls: list[Call] = []
        self.aborted: list[tuple[str, list[str]]] = []
        """(URL, request_ids) of every abort posted."""
        self.urls: dict[str, str] = {}
        self._runners: list[web.AppRunner] = []

    def stages(self) -> list[str]:
        return [c.stage for c in self.calls]

    def sent(self, stage: str) -> list[dict[str, Any]]:
        return [c.body for c in self.calls if c.stage == stage]

    async def start(self) -> None:
        for pool in POOLS:
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{path:.*}", partial(self._serve, pool))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            self._runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            host, port = runner.addresses[0][:2]
            self.urls[pool] = f"http://{host}:{port}"

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()

    async def _serve(self, pool: str, request: web.Request) -> web.StreamResponse:
        url = self.urls[pool]
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {"undecodable": raw.decode("latin-1")}
        if request.method == "POST" and request.path == ABORT_PATH:
            self.aborted.append((url, list(body.get("request_ids", []))))
            return web.json_response({})
        stage = STAGES.get((pool, request.path)) if request.method == "POST" else None
        if stage is None:
            self.calls.append(Call("unexpected", f"{request.method} {request.path}", body, url))
            return web.json_response({"error": {"message": "no such route"}}, status=404)
        if stage == "decode" and body.get("stream") is True and self.stream_lines is not None:
            self.calls.append(Call("decode_stream", request.path, copy.deepcopy(body), url))
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
            for line in self.stream_lines(body):
                await stream.write(line.rstrip(b"\n") + b"\n\n")
            await stream.write_eof()
            return stream
        self.calls.append(Call(stage, request.path, copy.deepcopy(body), url))
        return web.json_response(self.script[stage](body))
