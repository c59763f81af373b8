"""Limits that must hold whichever request path serves a client, and the data plane's control
API: a request without its key is refused before its body is read, a body that does not arrive
in time is 408, a request that waited out its timeout is 504 (never served again from the
start), one in-flight limit per gateway; only the gateway itself may call the control API.
Both paths answer with the same status and the same error."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from aiohttp import web

from tests.sim.gateway.adversarial.conftest import behind_data_plane
from tests.support.outcomes import TALLY, judge_json
from tests.support.serving import serving
from tests.support.sim_gateway import MODEL, PLAIN, Stack, ep, pd_stack, routing

KEY = "the-clients-key"
HANG = 10.0
"""An answer later than this waited for something it should not have."""


def error(status: int, kind: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def tally(case: str, request_path: str, status: int, body: Any) -> None:
    """One answer in the suite's outcome table (a JSON body, as raw_answer read it)."""
    verdict = judge_json(status, "application/json", json.dumps(body).encode(), chat=True)
    TALLY.add(f"{case} ({request_path})", verdict)


UNAUTHORIZED = error(
    401, "AuthenticationError", "missing or invalid API key: send Authorization: Bearer <key>"
)


async def raw_answer(client: httpx.AsyncClient, data: bytes) -> tuple[int, dict[str, Any]]:
    """Sends `data` on a new connection and reads the answer (status and JSON body) within
    HANG seconds; the rest of a body the head announced is never sent."""
    host, port = client.base_url.host, client.base_url.port
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG)
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        body = await asyncio.wait_for(reader.readexactly(length), HANG)
    finally:
        writer.close()
    return int(head.split(b" ", 2)[1]), json.loads(body)


@dataclass
class Hold:
    """The hanging engine's "hold" chats: `arrived` is set once one came, `release` answers
    them."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


async def hanging_engine(stack: Stack) -> tuple[str, Hold]:
    """An OpenAI engine that answers a chat at once unless its message is "hold": that one
    waits until released (a decode that hangs)."""
    hold = Hold()

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if body["messages"][-1]["content"] == "hold":
            hold.arrived.set()
            await hold.release.wait()
        return web.json_response(
            {
                "id": "chatcmpl-x",
                "object": "chat.completion",
                "created": 0,
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "done"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    url = await stack.exits.enter_async_context(serving(app))
    stack.exits.callback(hold.release.set)  # before the engine stops: its held answers end
    return url, hold


async def on_hanging_engine(
    stack: Stack, request_path: str, **settings: Any
) -> tuple[httpx.AsyncClient, Hold]:
    url, hold = await hanging_engine(stack)
    config = routing("openai", prefill=False, render=False, endpoints={"decode": [ep(url)]})
    client = await stack.gateway(
        config, data_plane=behind_data_plane(request_path), load_scrape_seconds=None, **settings
    )
    return client, hold


def chat(content: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


# ---- the key before the body, the body within its timeout ------------------------------------


async def test_a_request_without_its_key_is_refused_before_its_body_arrives(
    stack: Stack, request_path: str
) -> None:
    """Its body announced (1 MB) but never sent: refused at once, not after the body timeout."""
    client = await pd_stack(
        stack, data_plane=behind_data_plane(request_path), api_keys=(KEY,), body_timeout=30.0
    )
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000\r\n\r\n"
    )
    began = time.monotonic()
    status, body = await raw_answer(client, head + b'{"model": ')
    tally("no key, body never sent", request_path, status, body)
    assert (status, body) == (401, UNAUTHORIZED)
    assert time.monotonic() - began < HANG


async def test_a_large_keyless_upload_is_answered_401_not_reset(
    stack: Stack, request_path: str
) -> None:
    client = await pd_stack(stack, data_plane=behind_data_plane(request_path), api_keys=(KEY,))
    large = json.dumps({**PLAIN, "padding": "x" * (50 * 1024 * 1024)}).encode()
    response = await client.post(
        "/v1/chat/completions", content=large, headers={"Content-Type": "application/json"}
    )
    tally("no key, 50 MB upload", request_path, response.status_code, response.json())
    assert (response.status_code, response.json()) == (401, UNAUTHORIZED)


async def test_a_body_that_does_not_arrive_in_time_is_408(stack: Stack, request_path: str) -> None:
    client = await pd_stack(
        stack, data_plane=behind_data_plane(request_path), api_keys=(KEY,), body_timeout=1.0
    )
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n".encode()
    )
    began = time.monotonic()
    status, body = await raw_answer(client, head + b'{"model": ')
    message = "the request body did not arrive within 1 s"
    tally("body not in time", request_path, status, body)
    assert (status, body) == (408, error(408, "RequestTimeout", message))
    assert time.monotonic() - began >= 0.5  # the timeout, not a refusal of what did arrive


# ---- a request's deadline is its own, whichever path serves it ---------------------------------


async def test_a_request_that_waited_out_its_timeout_is_504_and_not_served_again(
    stack: Stack, request_path: str
) -> None:
    """A request whose timeout passed while it waited for decode is 504 as soon as it passed
    (handed over, it would wait a whole timeout more). The headers the data plane tells the
    gateway the time it spent with mean nothing from a client: a huge elapsed time does not cut
    a request short (sent gzipped, it goes through the Python gateway's intake on the data
    plane's path), a negative one
    does not give it more time."""
    client, _ = await on_hanging_engine(stack, request_path, request_timeout=1.0)
    shortened = {"X-PDServe-Elapsed-Ms": "999999", "X-PDServe-Dataplane-Token": "guessed"}
    response = await client.post(
        "/v1/chat/completions",
        content=gzip.compress(json.dumps(chat("quick")).encode()),
        headers={**shortened, "Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    tally(
        "a client's own elapsed-time headers", request_path, response.status_code, response.json()
    )
    assert response.status_code == 200, response.text
    lengthened = {"X-PDServe-Elapsed-Ms": "-60000", "X-PDServe-Dataplane-Token": "guessed"}
    began = time.monotonic()
    response = await client.post("/v1/chat/completions", json=chat("hold"), headers=lengthened)
    waited = time.monotonic() - began
    message = "decode at a replica did not answer within the request's limit of 1 s"
    tally("deadline while decode hangs", request_path, response.status_code, response.json())
    assert (response.status_code, response.json()) == (504, error(504, "GatewayTimeout", message))
    assert waited < 2.0, f"answered after {waited:.2f} s: its timeout started again"


# ---- one in-flight limit per gateway ----------------------------------------------------------


async def test_one_in_flight_limit_per_gateway_whichever_path_serves_a_request(
    stack: Stack, request_path: str
) -> None:
    """--max-inflight 1 and one request in flight (a gzip body: the data plane asks the Python
    gateway's intake about it, then serves it): the next is 429, however it would have been
    served."""
    client, hold = await on_hanging_engine(stack, request_path, max_inflight=1)
    held = asyncio.create_task(
        client.post(
            "/v1/chat/completions",
            content=gzip.compress(json.dumps(chat("hold")).encode()),
            headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
        )
    )
    try:
        await asyncio.wait_for(hold.arrived.wait(), HANG)
    except TimeoutError:
        raise AssertionError("the held request never reached the engine") from None
    response = await client.post("/v1/chat/completions", json=chat("quick"))
    message = "the gateway is at its limit of 1 requests in flight; retry shortly"
    tally("over the in-flight limit", request_path, response.status_code, response.json())
    assert (response.status_code, response.json()) == (429, error(429, "RateLimitError", message))
    assert response.headers["Retry-After"] == "1"
    hold.release.set()
    assert (await held).status_code == 200
    response = await client.post("/v1/chat/completions", json=chat("quick"))
    assert response.status_code == 200, response.text


# ---- the data plane's control API --------------------------------------------------------------


async def test_only_the_gateway_may_call_its_data_planes_control_api(stack: Stack) -> None:
    client = await pd_stack(stack, data_plane=True, api_keys=(KEY,))
    data_plane = stack.gateway_server.data_plane
    assert data_plane is not None
    assert data_plane.control is not None
    control = data_plane.control
    open_table = {"version": 10**9, "models": {}}  # newer than any the gateway pushed, no keys
    async with httpx.AsyncClient() as anyone:
        for token in (None, "guessed"):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            assert (await anyone.get(f"{control}/stats", headers=headers)).status_code == 401
            pushed = await anyone.put(f"{control}/table", json=open_table, headers=headers)
            assert pushed.status_code == 401
            assert (await anyone.post(f"{control}/drain", headers=headers)).status_code == 401
        # Even with the token, a table without the keys' digests is refused.
        pushed = await anyone.put(
            f"{control}/table", json=open_table, headers=data_plane.control_headers
        )
        assert pushed.status_code == 422
        assert "apiKeySha256" in pushed.text
    refused = await client.post("/v1/chat/completions", json=PLAIN)
    assert (refused.status_code, refused.json()) == (401, UNAUTHORIZED)
