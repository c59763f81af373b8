"""`Expect: 100-continue` on both request paths: the gateway invites the body (one `100
Continue`) only when it would read it; a body over the cap, or a request without the key, is
refused before the client sends it, in the OpenAI shape, and the connection closed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.sim.gateway.adversarial.conftest import behind_data_plane
from tests.support.outcomes import TALLY, Outcome, judge_json
from tests.support.sim_gateway import PLAIN, Stack, pd_stack

HANG = 10.0
BODY = json.dumps(PLAIN).encode()
CAP = 1024 * 1024
KEY = "client-key"


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG)
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
    return int(lines[0].split(" ", 2)[1]), {k.strip().lower(): v.strip() for k, v in fields.items()}


async def send(
    stack: Stack, request_path: str, head: bytes, body: bytes | None, **settings: Any
) -> tuple[list[int], int, bytes, bool]:
    """Send `head`; send `body` only after a 100 Continue. The interim statuses seen, the final
    status and body, and whether the gateway closed the connection after it."""
    client = await pd_stack(
        stack, data_plane=behind_data_plane(request_path), max_body_bytes=CAP, **settings
    )
    reader, writer = await asyncio.open_connection(client.base_url.host, client.base_url.port)
    try:
        writer.write(head)
        await writer.drain()
        interim: list[int] = []
        status, fields = await read_head(reader)
        while status == 100:
            interim.append(status)
            if body is not None and len(interim) == 1:
                writer.write(body)
                await writer.drain()
            status, fields = await read_head(reader)
        payload = await asyncio.wait_for(reader.readexactly(int(fields["content-length"])), HANG)
        verdict = judge_json(
            status, fields.get("content-type", "").split(";")[0], payload, chat=True
        )
        TALLY.add(f"Expect: 100-continue ({request_path})", verdict)
        assert verdict.outcome in (Outcome.ANSWERED, Outcome.CLEAR_ERROR), verdict
        closed = fields.get("connection", "").lower() == "close"
        if closed:
            assert await asyncio.wait_for(reader.read(), HANG) == b""
        return interim, status, payload, closed
    finally:
        writer.close()


def head(length: int, *extra: str) -> bytes:
    lines = [
        "POST /v1/chat/completions HTTP/1.1",
        "Host: gw",
        "Content-Type: application/json",
        f"Content-Length: {length}",
        *extra,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_a_body_within_the_cap_is_invited_once_and_answered(
    stack: Stack, request_path: str
) -> None:
    interim, status, _, _ = await send(
        stack, request_path, head(len(BODY), "Expect: 100-continue"), BODY
    )
    assert (interim, status) == ([100], 200)


@pytest.mark.parametrize("declared", [CAP + 1, 50 * 1024 * 1024])
async def test_a_declared_body_over_the_cap_is_refused_before_it_is_sent(
    stack: Stack, request_path: str, declared: int
) -> None:
    interim, status, payload, closed = await send(
        stack, request_path, head(declared, "Expect: 100-continue"), None
    )
    assert (interim, status, closed) == ([], 413, True)
    error = json.loads(payload)["error"]
    assert error["type"] == "RequestTooLarge"
    assert str(CAP) in error["message"]


async def test_a_request_without_the_key_is_refused_before_its_body(
    stack: Stack, request_path: str
) -> None:
    interim, status, payload, closed = await send(
        stack, request_path, head(len(BODY), "Expect: 100-continue"), None, api_keys=(KEY,)
    )
    assert (interim, status, closed) == ([], 401, True)
    assert json.loads(payload)["error"]["type"] == "AuthenticationError"


async def test_an_unknown_expectation_is_a_417(stack: Stack, request_path: str) -> None:
    interim, status, payload, _ = await send(
        stack, request_path, head(len(BODY), "Expect: something-else"), None
    )
    assert (interim, status) == ([], 417)
    assert json.loads(payload)["error"]["type"] == "ExpectationFailed"
