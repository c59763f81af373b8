"""The simulators' shared HTTP pieces: vLLM's error body, JSON requests, events, and a server
started in process."""

from __future__ import annotations

import json

import httpx
import pytest
from aiohttp import web

from pdserve.sim.engine_config import Faults
from pdserve.sim.http import (
    SSE_DONE,
    HttpError,
    error_response,
    health,
    open_sse,
    read_json,
    serving,
    sse_event,
)


def test_error_bodies_have_vllms_shape() -> None:
    response = error_response(404, "The model `x` does not exist.", "model")
    assert response.status == 404
    assert response.text is not None
    assert json.loads(response.text) == {
        "error": {
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert json.loads(error_response(410, "gone").text or "")["error"]["type"] == "Error"


def test_events_are_data_lines() -> None:
    assert sse_event({"a": 1}) == b'data: {"a": 1}\n\n'
    assert SSE_DONE == b"data: [DONE]\n\n"


async def test_a_server_in_process_answers_json_errors_and_events() -> None:
    async def echo(request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
        except HttpError as error:
            return error_response(error.status, error.message)
        response = await open_sse(request, {"Content-Type": "text/event-stream"})
        await response.write(sse_event(body))
        await response.write(SSE_DONE)
        return response

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_get("/health", health)
    async with serving(app) as port, httpx.AsyncClient() as client:
        base = f"http://127.0.0.1:{port}"
        assert (await client.get(f"{base}/health")).status_code == 200
        bad = await client.post(f"{base}/echo", content=b"not json")
        assert bad.status_code == 400
        assert bad.json()["error"]["message"] == "request body is not valid JSON"
        listed = await client.post(f"{base}/echo", json=[1])
        assert listed.json()["error"]["message"] == "request body must be a JSON object"
        ok = await client.post(f"{base}/echo", json={"x": 1})
        assert ok.headers["content-type"] == "text/event-stream"
        assert ok.text == 'data: {"x": 1}\n\ndata: [DONE]\n\n'


def test_faults_are_set_by_name_and_unknown_ones_refused() -> None:
    faults = Faults()
    faults.set({"http_5xx": 2, "drop_stream_after": 3})
    assert (faults.http_5xx, faults.drop_stream_after) == (2, 3)
    with pytest.raises(ValueError, match=r"unknown fault\(s\) \['nope'\]"):
        faults.set({"nope": 1})
